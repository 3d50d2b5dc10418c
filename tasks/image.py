"""Prefect tasks: the recipe's engine image on every node, and before the prefetch whether an
image that cannot be built here is on them (logic in sparkdeploy.steps.image)."""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from sparkdeploy.errors import TransientRemoteError
from sparkdeploy.remote.targets import plan_targets
from sparkdeploy.spec.plan import Plan
from sparkdeploy.steps.image import ImageReport, check_built_elsewhere, ensure_image
from sparkdeploy.steps.image.source import image_source
from tasks.artifacts import publish_table
from tasks.common import artifact_key, retried_on


@task(
    name="image",
    **retried_on(TransientRemoteError, 15, 60),
)
def ensure_images(plan: Plan) -> ImageReport:
    """Pulled (or built once and distributed) where missing; one image ID on every node. An
    image whose docker_image_dir is not in this checkout is used as the nodes hold it, or
    refused.

    Retried only when the registry was down or slow; an unknown image, refused credentials or
    a full disk fail at once.
    """
    logger = get_run_logger()
    image_dir, built_elsewhere = image_source(plan.recipe, plan.docker_image_dir)
    report = ensure_image(
        plan_targets(plan),
        plan.docker_image,
        image_dir=image_dir,
        built_elsewhere=built_elsewhere,
        registry=plan.registry,
        log=logger.info,
        warn=logger.warning,
    )
    publish_table(
        key=artifact_key("image", plan.deployment_id),
        table=[
            {
                "node": node.node,
                "action": node.action,
                "image_id": node.image_id,
                "layers_moved": node.layers_moved,
                "seconds": node.seconds,
            }
            for node in report.nodes
        ],
        description=f"{report.image} on the nodes of {plan.deployment_id}",
    )
    return report


@task(
    name="image-source",
    **retried_on(TransientRemoteError, 15, 60),
)
def check_image_source(plan: Plan) -> None:
    """Before the prefetch: a recipe whose image cannot be built here (its docker_image_dir is
    not in this checkout) is refused unless every node holds the image with one image ID.

    Only reads the nodes' docker; the image step puts the image on them, after the hold.
    """
    _, built_elsewhere = image_source(plan.recipe, plan.docker_image_dir)
    if built_elsewhere is not None:
        check_built_elsewhere(
            plan_targets(plan),
            plan.docker_image,
            built_elsewhere,
            warn=get_run_logger().warning,
        )
