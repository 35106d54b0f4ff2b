"""Each Darkroom container's environment parses as its service reads it.

The variables each container gets parse with the loader its service calls at start,
and name no DARKROOM_ variable its service would ignore; a bad shared setting stops
every service, and a bad or misspelt one of one service is caught."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from services.config.fields import SettingsError
from services.ops import SERVICE_MODULES
from services.ops.children import variables_read
from tests.deploy.environment import SECTIONS, container_env, darkroom_containers, load_settings
from tests.deploy.rendering import OVERLAYS, named, pods


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_container_environment_parses_as_its_service_reads_it(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    services = set()
    for pod, container, service in darkroom_containers(docs):
        env, own_names = container_env(container, pod, docs)
        load_settings(service, env, own_names)
        services.add(service)
    assert services == {*SERVICE_MODULES, "migrate"}


def test_a_bad_shared_setting_stops_every_service(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["fleet"])
    named(docs, "ConfigMap", "darkroom-settings")["data"]["DARKROOM_NATS_REPLICAS"] = "0"
    for pod, container, service in darkroom_containers(docs):
        env, own_names = container_env(container, pod, docs)
        with pytest.raises(SettingsError, match="DARKROOM_NATS_REPLICAS"):
            load_settings(service, env, own_names)


def test_a_bad_or_misspelt_setting_of_one_service_is_caught(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["fleet"]
    (pod,) = [p for p in pods(docs) if p.labels["app.kubernetes.io/component"] == "sampler"]
    (sampler,) = pod.spec["containers"]
    env, own_names = container_env(sampler, pod, docs)
    with pytest.raises(SettingsError, match="DARKROOM_SAMPLER_PORT"):
        load_settings("sampler", {**env, "DARKROOM_SAMPLER_PORT": "fifty"}, own_names)
    with pytest.raises(AssertionError, match="DARKROOM_SAMPLR_HOST is read by no service"):
        load_settings("sampler", {**env, "DARKROOM_SAMPLR_HOST": "x"}, own_names | {"DARKROOM_SAMPLR_HOST"})
    with pytest.raises(AssertionError, match="sampler does not read DARKROOM_HTTP_PORT"):
        load_settings("sampler", {**env, "DARKROOM_HTTP_PORT": "80"}, own_names | {"DARKROOM_HTTP_PORT"})


def test_a_supervisor_gives_each_service_the_section_its_main_reads() -> None:
    """``darkroom up`` and ``darkroom supervise`` pass each child only its own section
    and the kernel's (services/ops/children.py): the one its main() hands run_service."""
    for service, section in SECTIONS.items():
        assert section.variables() <= variables_read(service), service
