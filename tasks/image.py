"""Prefect task: the recipe's engine image on every node (logic in sparkdeploy.steps.image)."""

from __future__ import annotations

from prefect import task
from prefect.logging import get_run_logger

from sparkdeploy.errors import TransientRemoteError
from sparkdeploy.model.plan import Plan
from sparkdeploy.model.project import find_image_dir
from sparkdeploy.remote.targets import plan_targets
from sparkdeploy.steps.image import ImageReport, ensure_image
from tasks.artifacts import publish_table
from tasks.common import artifact_key, retry_only


@task(
    name="image",
    retries=2,
    retry_delay_seconds=[15, 60],
    retry_condition_fn=retry_only(TransientRemoteError),
)
def ensure_images(plan: Plan) -> ImageReport:
    """Pulled (or built once and distributed) where missing; one image ID on every node.

    Retried only when the registry was down or slow; an unknown image, refused credentials or
    a full disk fail at once.
    """
    logger = get_run_logger()
    image_dir = find_image_dir(plan.docker_image_dir) if plan.docker_image_dir else None
    report = ensure_image(
        plan_targets(plan),
        plan.docker_image,
        image_dir=image_dir,
        registry=plan.registry,
        log=logger.info,
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
