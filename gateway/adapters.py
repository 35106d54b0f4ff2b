"""A request's LoRA adapters: checked as the request is (``violations``: how many,
well-formed names, finite scales, none twice), then resolved before anything is
stored or charged, once its tenant's limits let it in (``AdapterResolver``): each
must be an adapter the caller may name (its tenant's own first, else a published
one: an operator's in the model store, or a tenant's an operator published), for
the model's family, of a rank the model takes. A name without a version gets the
latest, which the job keeps.

Every name the caller may not use is refused alike, whether nothing has that name,
another tenant keeps it, or it is a model: the refusals tell a tenant nothing of
what it may not see."""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime

from services.config.model_store import ModelStoreSettings
from services.db.adapter_records import TenantAdapter
from services.db.repository.adapters import Adapters
from services.errors import FieldViolation, InvalidArgument, ModelError, StoreUnavailable
from services.generation import AdapterUse
from services.models.spec import ModelSpec
from services.models.store.errors import ModelNotInStore, ModelStoreError
from services.models.store.manifest import Manifest, parse_reference
from services.models.store.objects import ObjectStore
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

# The largest scale a request may give (either way): far past any adapter's use.
MAX_SCALE = 8.0
# How long a manifest read from the store stands for its name (a push of a new
# latest is seen within it), and how long its absence does (a name just pushed is
# found within it, and a flood of unknown names costs the store little).
MANIFEST_TTL_S = 30.0
ABSENT_TTL_S = 2.0
# The most names the catalog keeps (least recently asked for go first): names come
# from clients, and a client may send a new one with every request.
MAX_KEPT = 1024
# Reads of the store in flight at once; the rest wait for one of them.
READS_AT_ONCE = 4
KIND = "lora"


def requested(req: pb.SubmitJobRequest) -> tuple[AdapterUse, ...]:
    """The adapters ``req`` names, a version "" where it names none (the latest)."""
    uses = []
    for adapter in req.adapters:
        name, _, version = adapter.name.partition(":")
        uses.append(AdapterUse(name, version, float(adapter.scale) if adapter.HasField("scale") else 1.0))
    return tuple(uses)


def violations(req: pb.SubmitJobRequest, spec: ModelSpec) -> list[FieldViolation]:
    if not req.adapters:
        return []
    if not spec.adapter_slots:
        return [FieldViolation("adapters", f"model {spec.name!r} takes no adapters")]
    bad = []
    if len(req.adapters) > spec.adapters_per_job:
        bad.append(
            FieldViolation("adapters", f"{len(req.adapters)} adapters; {spec.name!r} takes {spec.adapters_per_job}")
        )
    seen: set[str] = set()
    for i, adapter in enumerate(req.adapters):
        try:
            name, _ = parse_reference(adapter.name)
        except ModelError as exc:
            bad.append(FieldViolation(f"adapters[{i}].name", str(exc)))
            continue
        if name in seen:
            bad.append(FieldViolation(f"adapters[{i}].name", f"{name!r} is named twice"))
        seen.add(name)
        if adapter.HasField("scale") and not (math.isfinite(adapter.scale) and abs(adapter.scale) <= MAX_SCALE):
            bad.append(FieldViolation(f"adapters[{i}].scale", f"{adapter.scale} is outside -{MAX_SCALE}..{MAX_SCALE}"))
    return bad


class AdapterCatalog:
    """The model store's adapters as a gateway sees them: manifests read in a thread
    (``READS_AT_ONCE`` at a time, one read per name however many ask at once) and
    kept ``ttl_s``, at most ``max_kept`` of them. ``store`` makes the store's client
    (None: no store here)."""

    def __init__(
        self,
        store: Callable[[], ObjectStore | None],
        *,
        ttl_s: float = MANIFEST_TTL_S,
        max_kept: int = MAX_KEPT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._make_store = store
        self._store: ObjectStore | None = None
        self._ttl_s = ttl_s
        self._max_kept = max_kept
        self._clock = clock
        self._manifests: OrderedDict[tuple[str, str], tuple[float, Manifest | None]] = OrderedDict()
        self._reading: dict[tuple[str, str], asyncio.Future[Manifest | None]] = {}
        self._reads = asyncio.Semaphore(READS_AT_ONCE)
        self._listing_lock = asyncio.Lock()
        self._listed: tuple[float, list[tuple[Manifest, datetime]]] | None = None

    @property
    def kept(self) -> int:
        return len(self._manifests)

    async def adapter(self, name: str, version: str) -> Manifest | None:
        """The store's adapter ``name`` (``version``, "" for its latest); None where
        the store holds none by that name (or holds a model by it)."""
        manifest = await self._manifest(name, version)
        return manifest if manifest is not None and manifest.entry.get("kind") == KIND else None

    async def _manifest(self, name: str, version: str) -> Manifest | None:
        key = (name, version)
        cached = self._manifests.get(key)
        if cached is not None and self._clock() - cached[0] < (self._ttl_s if cached[1] is not None else ABSENT_TTL_S):
            self._manifests.move_to_end(key)
            return cached[1]
        reading = self._reading.get(key)
        if reading is None:
            # A task of its own: a caller that goes away (its client cancelled) cancels
            # neither the read nor the others waiting on it.
            reading = asyncio.ensure_future(self._read_and_keep(key))
            self._reading[key] = reading
            reading.add_done_callback(lambda _: self._reading.pop(key, None))
        return await asyncio.shield(reading)

    async def _read_and_keep(self, key: tuple[str, str]) -> Manifest | None:
        now = self._clock()
        async with self._reads:
            manifest = await asyncio.to_thread(self._read, *key)
        self._manifests[key] = (now, manifest)
        self._manifests.move_to_end(key)
        while len(self._manifests) > self._max_kept:
            self._manifests.popitem(last=False)
        return manifest

    async def listing(self) -> list[tuple[Manifest, datetime]]:
        """Every version of the store's adapters and when each was pushed, read once
        per ``ttl_s`` however many ask."""
        async with self._listing_lock:
            now = self._clock()
            if self._listed is None or now - self._listed[0] >= self._ttl_s:
                async with self._reads:
                    found = await asyncio.to_thread(self._list)
                self._listed = (now, [(m, at) for m, at in found if m.entry.get("kind") == KIND])
            return self._listed[1]

    def _list(self) -> list[tuple[Manifest, datetime]]:
        if self._store is None:
            self._store = self._make_store()
        if self._store is None:
            return []
        try:
            return self._store.manifests()
        except ModelStoreError as exc:
            raise StoreUnavailable(f"the model store cannot list its adapters now: {exc}") from exc

    def _read(self, name: str, version: str) -> Manifest | None:
        if self._store is None:
            self._store = self._make_store()
        if self._store is None:
            return None
        try:
            return self._store.read_manifest(name, version or None)
        except ModelNotInStore:
            return None
        except ModelStoreError as exc:
            raise StoreUnavailable(f"the model store cannot tell the adapters apart now: {exc}") from exc


class AdapterResolver:
    """A submit's adapters, each the caller's own (``tenant_adapters``), else a
    published tenant's, else the store's (``catalog``)."""

    def __init__(self, repo: Adapters | None, catalog: AdapterCatalog) -> None:
        self.repo = repo
        self.catalog = catalog

    async def resolve(self, tenant: str, uses: Sequence[AdapterUse], spec: ModelSpec) -> tuple[AdapterUse, ...]:
        """Each of ``uses`` with its version (and owner), or InvalidArgument naming
        each the caller may not name or that does not fit ``spec``; StoreUnavailable
        where the store or the database does not answer."""
        if not uses:
            return ()
        resolved, bad = [], []
        for i, use in enumerate(uses):
            found = await self._find(tenant, use)
            field = f"adapters[{i}].name"
            if isinstance(found, TenantAdapter):
                misfit = fits(found.reference, found.family, found.rank, spec)
                resolved.append(replace(use, version=found.version, owner=found.tenant))
            elif found is not None:
                entry = found.entry
                what = f"{found.name}:{found.version}"
                misfit = fits(what, str(entry.get("family")), int(entry.get("rank", 0)), spec)
                resolved.append(replace(use, version=found.version))
            else:
                what = f"{use.name}:{use.version}" if use.version else use.name
                misfit = f"no adapter {what!r} is yours or published (ListAdapters lists those you may name)"
            if misfit:
                bad.append(FieldViolation(field, misfit))
        if bad:
            raise InvalidArgument(bad)
        return tuple(resolved)

    async def _find(self, tenant: str, use: AdapterUse) -> TenantAdapter | Manifest | None:
        if self.repo is not None:
            own = await self.repo.visible(tenant, use.name, use.version or None)
            if own is not None:
                return own
        return await self.catalog.adapter(use.name, use.version)


def fits(what: str, family: str, rank: int, spec: ModelSpec) -> str:
    """Why an adapter of ``family`` and ``rank`` cannot adapt ``spec``'s jobs; "" where it can."""
    if family != spec.family:
        return f"{what!r} adapts {family} models; {spec.name!r} is a {spec.family} model"
    if rank > spec.adapter_rank:
        return f"{what!r} has rank {rank}; {spec.name!r} takes {spec.adapter_rank} at most"
    return ""


def store_of(settings: ModelStoreSettings) -> Callable[[], ObjectStore | None]:
    """The store's client where ``settings`` name one (a gateway is given its own identity)."""

    def make() -> ObjectStore | None:
        return ObjectStore.from_settings(settings) if settings.model_store_url else None

    return make
