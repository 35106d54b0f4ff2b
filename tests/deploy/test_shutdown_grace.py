"""Each pod is given the time its service takes to stop.

terminationGracePeriodSeconds covers the preStop sleep and the service's own shutdown,
in multiples of the DARKROOM_SHUTDOWN_GRACE_S it reads, with a margin."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.environment import container_env, load_settings, service_of
from tests.deploy.rendering import OVERLAYS, pods

# How long each service may take to stop, in DARKROOM_SHUTDOWN_GRACE_S: a sampler
# drains (the jobs decoding get the grace), then closes its gRPC server (the grace
# again); the others close their server alone.
GRACES_TO_STOP = {"gateway": 1, "http": 1, "scheduler": 1, "sampler": 2, "decoder": 1}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_pod_is_given_the_time_its_service_takes_to_stop(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    for pod in pods(docs):
        (container,) = pod.spec["containers"]
        service = service_of(container)
        assert service is not None
        env, own_names = container_env(container, pod, docs)
        kernel, _ = load_settings(service, env, own_names)
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        waited = int(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0
        needed = waited + GRACES_TO_STOP[service] * kernel.shutdown_grace_s + 5
        assert pod.spec["terminationGracePeriodSeconds"] >= needed, f"{service} needs {needed}s to stop"
