"""The gateway's view of the adapters a caller may name, over plain manifests and
records: a manifest stands for its name for its TTL (a new latest is seen after
it), an absence for far less (an adapter just pushed is found within seconds), the
catalog keeps a bounded number of names whatever clients send, and reads one name
once however many ask at once; a tenant's own adapter comes before a published
one; every name the caller may not use (none, another tenant's, a model) is
refused alike; a store that fails is UNAVAILABLE, never a user's mistake."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime
from typing import Any

import pytest

from gateway.adapters import ABSENT_TTL_S, MANIFEST_TTL_S, AdapterCatalog, AdapterResolver
from services.db.adapter_records import TenantAdapter
from services.errors import InvalidArgument, StoreUnavailable
from services.generation import AdapterUse
from services.models.registry import ModelRegistry
from services.models.store.errors import ModelNotInStore, ModelStoreUnavailable
from services.models.store.manifest import Manifest

TINY = ModelRegistry.load().get("tiny")
NOW = datetime(2026, 12, 7, tzinfo=UTC)


def adapter(version: str, rank: int = 4, family: str = "tiny", name: str = "style") -> Manifest:
    return Manifest(name, version, (), {"kind": "lora", "family": family, "rank": rank})


class Store:
    """Manifests by (name, version or None for the latest), counting reads."""

    def __init__(self) -> None:
        self.latest: dict[str, Manifest] = {}
        self.reads = 0
        self.down = False
        self.gate: threading.Event | None = None

    def read_manifest(self, name: str, version: str | None = None) -> Manifest:
        self.reads += 1
        if self.gate is not None:
            self.gate.wait(5)
        if self.down:
            raise ModelStoreUnavailable("connection refused")
        found = self.latest.get(name)
        if found is None or (version is not None and version != found.version):
            raise ModelNotInStore(f"{name} is not in the model store")
        return found


class Records:
    """Tenants' adapters as ``Adapters.visible`` finds them."""

    def __init__(self, *adapters: TenantAdapter) -> None:
        self.adapters = adapters

    async def visible(self, tenant: str, name: str, version: str | None) -> TenantAdapter | None:
        mine = [a for a in self.adapters if a.name == name and (version is None or a.version == version)]
        mine.sort(key=lambda a: (a.tenant != tenant, not a.published))
        found = [a for a in mine if a.tenant == tenant or a.published]
        return found[0] if found else None


def tenant_adapter(tenant: str, version: str, *, published: bool = False, family: str = "tiny") -> TenantAdapter:
    return TenantAdapter(tenant, "style", version, family, "tiny", 4, 10, 1000, NOW, stored=True, published=published)


def resolve(catalog: AdapterCatalog, *uses: AdapterUse, records: Any = None, tenant: str = "acme") -> Any:
    return asyncio.run(AdapterResolver(records, catalog).resolve(tenant, uses, TINY))


def test_manifests_are_kept_for_their_ttl_and_absences_for_far_less() -> None:
    store, now = Store(), [0.0]
    catalog = AdapterCatalog(lambda: store, clock=lambda: now[0])  # type: ignore[arg-type, return-value]
    with pytest.raises(InvalidArgument, match="no adapter 'style' is yours or published"):
        resolve(catalog, AdapterUse("style", ""))
    store.latest["style"] = adapter("v1")
    now[0] = ABSENT_TTL_S + 0.1  # pushed: found once the absence is stale
    assert resolve(catalog, AdapterUse("style", "", 0.5)) == (AdapterUse("style", "v1", 0.5),)
    store.latest["style"] = adapter("v2")
    now[0] += MANIFEST_TTL_S - 1  # the latest as it was read, until its TTL is over
    assert resolve(catalog, AdapterUse("style", ""))[0].version == "v1"
    now[0] += 2
    assert resolve(catalog, AdapterUse("style", ""))[0].version == "v2"
    assert store.reads == 3


def test_the_catalog_keeps_a_bounded_number_of_names_whatever_clients_send() -> None:
    store = Store()
    catalog = AdapterCatalog(lambda: store, max_kept=8)  # type: ignore[arg-type, return-value]

    async def flood() -> None:
        for i in range(100):
            assert await catalog.adapter(f"unknown-{i}", "") is None

    asyncio.run(flood())
    assert catalog.kept == 8 and store.reads == 100


def test_one_name_asked_for_at_once_is_read_once() -> None:
    store = Store()
    store.latest["style"] = adapter("v1")
    store.gate = threading.Event()
    catalog = AdapterCatalog(lambda: store)  # type: ignore[arg-type, return-value]

    async def many() -> list[Manifest | None]:
        asked = [asyncio.ensure_future(catalog.adapter("style", "")) for _ in range(20)]
        await asyncio.sleep(0.05)
        assert store.gate is not None
        store.gate.set()
        return await asyncio.gather(*asked)

    found = asyncio.run(many())
    assert store.reads == 1 and {m.version for m in found if m is not None} == {"v1"} and None not in found


def test_a_caller_that_goes_away_cancels_neither_the_read_nor_the_others_waiting() -> None:
    store = Store()
    store.latest["style"] = adapter("v1")
    store.gate = threading.Event()
    catalog = AdapterCatalog(lambda: store)  # type: ignore[arg-type, return-value]

    async def one_leaves() -> Manifest | None:
        first = asyncio.ensure_future(catalog.adapter("style", ""))
        second = asyncio.ensure_future(catalog.adapter("style", ""))
        await asyncio.sleep(0.05)
        first.cancel()
        assert store.gate is not None
        store.gate.set()
        return await second

    found = asyncio.run(one_leaves())
    assert found is not None and found.version == "v1" and store.reads == 1


def test_adapters_that_do_not_fit_the_model_are_named() -> None:
    store = Store()
    store.latest["style"] = adapter("v1", rank=64)
    catalog = AdapterCatalog(lambda: store)  # type: ignore[arg-type, return-value]
    with pytest.raises(InvalidArgument, match="has rank 64; 'tiny' takes 16 at most") as refused:
        resolve(catalog, AdapterUse("style", "v1"))
    assert [v.field for v in refused.value.violations] == ["adapters[0].name"]


def test_a_model_another_tenants_adapter_and_no_adapter_are_refused_alike() -> None:
    store = Store()
    store.latest["a-model"] = Manifest("a-model", "v2", (), {})  # a model, not an adapter
    catalog = AdapterCatalog(lambda: store)  # type: ignore[arg-type, return-value]
    records = Records(tenant_adapter("other", "v1"))
    messages = []
    for name in ("a-model", "style", "nothing"):
        with pytest.raises(InvalidArgument) as refused:
            resolve(catalog, AdapterUse(name, ""), records=records)
        messages.append(refused.value.violations[0].description.replace(repr(name), "NAME"))
    assert len(set(messages)) == 1, messages


def test_the_callers_own_adapter_comes_first_then_a_published_one_then_the_stores() -> None:
    store = Store()
    store.latest["style"] = adapter("store-v")
    catalog = AdapterCatalog(lambda: store)  # type: ignore[arg-type, return-value]
    mine, published = tenant_adapter("acme", "mine"), tenant_adapter("other", "theirs", published=True)
    assert resolve(catalog, AdapterUse("style", ""), records=Records(mine, published)) == (
        AdapterUse("style", "mine", owner="acme"),
    )
    assert resolve(catalog, AdapterUse("style", ""), records=Records(published)) == (
        AdapterUse("style", "theirs", owner="other"),
    )
    assert resolve(catalog, AdapterUse("style", ""), records=Records()) == (AdapterUse("style", "store-v"),)
    with pytest.raises(InvalidArgument, match="adapts flux models"):  # a published one: its misfit is told
        resolve(
            catalog,
            AdapterUse("style", ""),
            records=Records(tenant_adapter("other", "f", published=True, family="flux")),
        )


def test_a_store_that_fails_is_unavailable_and_no_store_knows_no_adapter() -> None:
    store = Store()
    store.down = True
    with pytest.raises(StoreUnavailable):
        resolve(AdapterCatalog(lambda: store), AdapterUse("style", "v1"))  # type: ignore[arg-type, return-value]
    with pytest.raises(InvalidArgument, match="no adapter 'style:v1' is yours or published"):
        resolve(AdapterCatalog(lambda: None), AdapterUse("style", "v1"))
