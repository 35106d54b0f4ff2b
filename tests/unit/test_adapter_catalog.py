"""The gateway's view of the store's adapters, over plain manifests: a manifest
stands for its name for its TTL (a new latest is seen after it), an absence for
far less (an adapter just pushed is found within seconds), and a store that fails
is UNAVAILABLE, never a user's mistake."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.adapters import ABSENT_TTL_S, MANIFEST_TTL_S, AdapterCatalog
from services.errors import InvalidArgument, StoreUnavailable
from services.generation import AdapterUse
from services.models.registry import ModelRegistry
from services.models.store.errors import ModelNotInStore, ModelStoreUnavailable
from services.models.store.manifest import Manifest

TINY = ModelRegistry.load().get("tiny")


def adapter(version: str, rank: int = 4, family: str = "tiny") -> Manifest:
    return Manifest("style", version, (), {"kind": "lora", "family": family, "rank": rank})


class Store:
    """Manifests by (name, version or None for the latest), counting reads."""

    def __init__(self) -> None:
        self.latest: Manifest | None = None
        self.reads = 0
        self.down = False

    def read_manifest(self, name: str, version: str | None = None) -> Manifest:
        self.reads += 1
        if self.down:
            raise ModelStoreUnavailable("connection refused")
        if self.latest is None or (version is not None and version != self.latest.version):
            raise ModelNotInStore(f"{name} is not in the model store")
        return self.latest


def resolve(catalog: AdapterCatalog, *uses: AdapterUse) -> Any:
    return asyncio.run(catalog.resolve(uses, TINY))


def test_manifests_are_kept_for_their_ttl_and_absences_for_far_less() -> None:
    store, now = Store(), [0.0]
    catalog = AdapterCatalog(lambda: store, clock=lambda: now[0])  # type: ignore[arg-type, return-value]
    with pytest.raises(InvalidArgument, match="'style' is not in the model store"):
        resolve(catalog, AdapterUse("style", ""))
    store.latest = adapter("v1")
    now[0] = ABSENT_TTL_S + 0.1  # pushed: found once the absence is stale
    assert resolve(catalog, AdapterUse("style", "", 0.5)) == (AdapterUse("style", "v1", 0.5),)
    store.latest = adapter("v2")
    now[0] += MANIFEST_TTL_S - 1  # the latest as it was read, until its TTL is over
    assert resolve(catalog, AdapterUse("style", ""))[0].version == "v1"
    now[0] += 2
    assert resolve(catalog, AdapterUse("style", ""))[0].version == "v2"
    assert store.reads == 3


def test_adapters_that_do_not_fit_the_model_are_named() -> None:
    store = Store()
    store.latest = adapter("v1", rank=64)
    catalog = AdapterCatalog(lambda: store)  # type: ignore[arg-type, return-value]
    with pytest.raises(InvalidArgument, match="has rank 64; 'tiny' takes 16 at most") as refused:
        resolve(catalog, AdapterUse("style", "v1"))
    assert [v.field for v in refused.value.violations] == ["adapters[0].name"]
    store.latest = Manifest("style", "v2", (), {})  # a model, not an adapter
    with pytest.raises(InvalidArgument, match="'style:v2' is a model, not an adapter"):
        resolve(catalog, AdapterUse("style", "v2"))


def test_a_store_that_fails_is_unavailable_and_no_store_knows_no_adapter() -> None:
    store = Store()
    store.down = True
    with pytest.raises(StoreUnavailable):
        resolve(AdapterCatalog(lambda: store), AdapterUse("style", "v1"))  # type: ignore[arg-type, return-value]
    with pytest.raises(InvalidArgument, match="not in the model store"):
        resolve(AdapterCatalog(lambda: None), AdapterUse("style", "v1"))
