"""The model store in the manifests: the sampler and decoder pods read it as the
reader, from a Secret no other pod names; the other services are given nothing of
the store, and no pod the writer's identity (docs/security.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.deploy.environment import container_env, darkroom_containers, load_settings
from tests.deploy.rendering import OVERLAYS, READER_ENV, named, pods

READER_SECRET = "darkroom-model-store-reader"
STORE_READERS = {"sampler", "decoder"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_samplers_and_decoders_read_the_store_as_the_reader_and_no_service_holds_the_writer(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    secret = named(docs, "Secret", READER_SECRET)["metadata"]["name"]
    for pod in pods(docs):
        component = pod.labels["app.kubernetes.io/component"]
        assert (secret in json.dumps(pod.spec)) == (component in STORE_READERS), pod.name

    readers = set()
    for pod, container, service in darkroom_containers(docs):
        env, own_names = container_env(container, pod, docs)
        store = load_settings(service, env, own_names)[0].model_store
        held = (store.model_store_url, store.model_store_access_key, store.model_store_secret_key)
        assert not store.model_store_writer_access_key and not store.model_store_writer_secret_key, pod.name
        if service in STORE_READERS:
            assert held == READER_ENV, pod.name
            readers.add(service)
        else:
            assert held == ("", "", ""), pod.name
    assert readers == STORE_READERS
