"""`python -m lab up [--nodes N] [--ops-hosts N] [--name NAME] [--brownfield]`,
`python -m lab down [--name NAME]`,
`python -m lab status [--name NAME]`, `python -m lab image [--name NAME]`,
`python -m lab models [--name NAME]` (the lab recipes' models, into the lab hub),
`python -m lab real-engine [--name NAME]` (real vLLM's CPU build: runtime, image and model)."""

from __future__ import annotations

import argparse
import json
import sys

from lab.brownfield import BROWNFIELD_IMAGE, BROWNFIELD_RECIPE, LANE_DIR, make_brownfield
from lab.cluster import Lab
from lab.image import build_engine_image
from lab.layout import DEFAULT_NAME, DEFAULT_NODES
from lab.models import publish_lab_models
from lab.vllm_runtime import prepare_real_engine
from sparkdeploy.errors import SparkDeployError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="bring the lab up (cleans a crashed one first)")
    up.add_argument("--nodes", type=int, default=DEFAULT_NODES)
    up.add_argument("--name", default=DEFAULT_NAME)
    up.add_argument(
        "--ops-hosts",
        type=int,
        default=0,
        help="hosts on the lab fabric for Prefect workers (no sshd or dockerd)",
    )
    up.add_argument(
        "--brownfield",
        action="store_true",
        help="then put it in the state the old launcher leaves for recipes/lab-dsv41-brownfield"
        " (lab/brownfield.py): hand-made Engram copies another lane hardlinks, an hf download"
        " NAS cache, a :local image on every node, a container that is not ours",
    )
    for command, help_text in (
        ("down", "tear the lab down, leaving nothing"),
        ("status", "addresses and processes of the lab, as JSON"),
        ("image", "build the engine stand-in image and push it to the lab registry"),
        ("models", "generate the lab recipes' model repos into the lab hub"),
        (
            "real-engine",
            "install real vLLM's CPU build (cached), push its image and publish its model",
        ),
    ):
        commands.add_parser(command, help=help_text).add_argument("--name", default=DEFAULT_NAME)
    options = parser.parse_args(argv)
    try:
        if options.command == "up":
            lab = Lab(options.name, options.nodes, options.ops_hosts)
            seconds = lab.up()
            print(f"lab {lab.name!r} up in {seconds:.2f} s; inventory: {lab.inventory_path}")
            if options.brownfield:
                build_engine_image(lab)
                publish_lab_models(lab.hub_repos_dir)
                field = make_brownfield(lab, str(BROWNFIELD_RECIPE))
                print(
                    f"brownfield: {len(field.copies)} hand-made Engram copies (lane links under"
                    f" {LANE_DIR}), NAS cache of {', '.join(field.nas_repos)} from"
                    f" snapshot_download, {BROWNFIELD_IMAGE} ({field.image_id[:19]}) on every"
                    f" node, container {field.foreign_container} on {field.foreign_node}; deploy"
                    f" {BROWNFIELD_RECIPE.name} onto it"
                )
        elif options.command == "down":
            seconds = Lab(options.name).down()
            print(f"lab {options.name!r} down in {seconds:.2f} s")
        elif options.command == "status":
            try:
                lab = Lab.existing(options.name)
            except SparkDeployError:
                lab = Lab(options.name)
            print(json.dumps(lab.status(), indent=2))
        elif options.command == "models":
            published = publish_lab_models(Lab.existing(options.name).hub_repos_dir)
            for repo in published.values():
                print(f"{repo.repo_id}: {len(repo.files)} files, {repo.total_bytes} bytes")
        elif options.command == "real-engine":
            engine = prepare_real_engine(Lab.existing(options.name))
            print(f"real engine ready: image {engine.image}, runtime {engine.runtime}")
        else:
            print(build_engine_image(Lab.existing(options.name)))
    except SparkDeployError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
