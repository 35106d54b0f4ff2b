"""The model store in the manifests: each role that reads the store reads it with an
identity of its own, from a Secret no other pod names (the decoders the reader's,
the samplers theirs, the gateway its own: the adapters a request names resolve on
Kubernetes too); the scheduler and the HTTP API are given nothing of the store, and
no pod the writer's identity (docs/security.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.deploy.environment import container_env, darkroom_containers, load_settings
from tests.deploy.rendering import OVERLAYS, STORE_ENVS, named, pods

# Which Secret, and so which identity, each component reads the store with.
SECRET_OF = {
    "decoder": "darkroom-model-store-reader",
    "sampler": "darkroom-model-store-sampler",
    "gateway": "darkroom-model-store-gateway",
}
ROLE_OF = {"decoder": "reader", "sampler": "sampler", "gateway": "gateway"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_role_reads_the_store_with_its_own_identity_and_no_service_holds_the_writer(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    secrets = {component: named(docs, "Secret", name)["metadata"]["name"] for component, name in SECRET_OF.items()}
    for pod in pods(docs):
        component = pod.labels["app.kubernetes.io/component"]
        spec = json.dumps(pod.spec)
        named_here = {owner for owner, secret in secrets.items() if secret in spec}
        assert named_here == ({component} if component in SECRET_OF else set()), pod.name

    holders = set()
    for pod, container, service in darkroom_containers(docs):
        env, own_names = container_env(container, pod, docs)
        store = load_settings(service, env, own_names)[0].model_store
        held = (store.model_store_url, store.model_store_access_key, store.model_store_secret_key)
        for role in ("writer", "sampler", "gateway"):
            assert not getattr(store, f"model_store_{role}_access_key"), (pod.name, role)
            assert not getattr(store, f"model_store_{role}_secret_key"), (pod.name, role)
        if service in ROLE_OF:
            assert held == STORE_ENVS[ROLE_OF[service]], pod.name
            holders.add(service)
        else:
            assert held == ("", "", ""), pod.name
    assert holders == set(ROLE_OF)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_samplers_hold_the_key_that_signs_compiled_artifacts(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """What a sampler loads from compiled/ runs: only the samplers hold the key whose
    signature it must carry, and each points its setting into that key's mount."""
    docs = rendered[overlay]
    secret = named(docs, "Secret", "darkroom-compile-signing")["metadata"]["name"]
    for pod in pods(docs):
        component = pod.labels["app.kubernetes.io/component"]
        assert (secret in json.dumps(pod.spec)) == (component == "sampler"), pod.name
    for pod, container, service in darkroom_containers(docs):
        env, own_names = container_env(container, pod, docs)
        held = env.get("DARKROOM_COMPILE_SIGNING_KEY_FILE", "")
        if service != "sampler":
            assert not held, pod.name
            continue
        mounts = {v["name"]: v for v in pod.spec["volumes"]}
        [mount] = [m for m in container["volumeMounts"] if held.startswith(m["mountPath"] + "/")]
        assert mounts[mount["name"]]["secret"]["secretName"] == secret and mount["readOnly"], pod.name
        assert load_settings(service, env, own_names)[1].compile_signing_key is not None  # type: ignore[attr-defined]
