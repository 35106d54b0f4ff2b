"""The Dockerfile builds the images the manifests run.

infra/docker/Dockerfile's stages copy only from earlier stages, its header builds each
image from its target, and every container of every overlay runs the image its
service belongs in: darkroom-control or darkroom-gpu."""

from __future__ import annotations

import re
from typing import Any

from tests.deploy.environment import service_of
from tests.deploy.rendering import DOCKERFILE, OVERLAYS, pods

# Which image each service runs: the Dockerfile's targets, by the names infra/k8s uses.
IMAGE_OF_SERVICE = {
    "gateway": "darkroom-control",
    "http": "darkroom-control",
    "scheduler": "darkroom-control",
    "migrate": "darkroom-control",
    "sampler": "darkroom-gpu",
    "decoder": "darkroom-gpu",
}
TARGET_OF_IMAGE = {"darkroom-control": "control", "darkroom-gpu": "gpu"}


def dockerfile_stages() -> tuple[list[str], list[tuple[str, str]]]:
    """The Dockerfile's stage names in order, and each (stage, stage it copies from)."""
    stages: list[str] = []
    copies = []
    for line in DOCKERFILE.read_text().splitlines():
        if m := re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE):
            stages.append(m[1])
        for source in re.findall(r"COPY\s+--from=(\S+)", line):
            copies.append((stages[-1], source))
    return stages, copies


def test_the_dockerfile_builds_the_images_the_manifests_run(rendered: dict[str, list[dict[str, Any]]]) -> None:
    stages, copies = dockerfile_stages()
    for stage, source in copies:
        assert source in stages[: stages.index(stage)], f"{stage} copies from {source}, not an earlier stage"
    assert set(TARGET_OF_IMAGE.values()) <= set(stages)
    header = DOCKERFILE.read_text()
    for image, target in TARGET_OF_IMAGE.items():
        assert re.search(rf"--target\s+{target}\s+-t\s+{image}\s", header), f"the header builds no {image}"

    for overlay in OVERLAYS:
        for pod in pods(rendered[overlay]):
            for container in [*pod.spec.get("initContainers", []), *pod.spec["containers"]]:
                image = container["image"].rsplit("/", 1)[-1].split(":")[0]
                service = service_of(container) or pod.labels["app.kubernetes.io/component"]
                assert image == IMAGE_OF_SERVICE[service], f"{overlay}: {container['name']} runs {image}"
