"""A request's LoRA adapters: checked as the request is (``violations``: how many,
well-formed names, finite scales, none twice), then resolved against the model
store before anything is stored or charged (``AdapterCatalog``): each must be an
adapter of the store, for the model's family, of a rank the model takes. A name
without a version gets the latest, which the job keeps."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from services.config.model_store import ModelStoreSettings
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
    and kept ``ttl_s``. ``store`` makes the store's client (None: no store here)."""

    def __init__(
        self,
        store: Callable[[], ObjectStore | None],
        *,
        ttl_s: float = MANIFEST_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._make_store = store
        self._store: ObjectStore | None = None
        self._ttl_s = ttl_s
        self._clock = clock
        self._manifests: dict[tuple[str, str], tuple[float, Manifest | None]] = {}

    async def resolve(self, uses: Sequence[AdapterUse], spec: ModelSpec) -> tuple[AdapterUse, ...]:
        """Each of ``uses`` with its version, or InvalidArgument naming each that
        the store lacks or that does not fit ``spec``; StoreUnavailable where the
        store does not answer."""
        if not uses:
            return ()
        resolved, bad = [], []
        for i, use in enumerate(uses):
            field = f"adapters[{i}].name"
            manifest = await self._manifest(use.name, use.version)
            what = f"{use.name}:{use.version}" if use.version else use.name
            if manifest is None:
                bad.append(FieldViolation(field, f"{what!r} is not in the model store"))
                continue
            misfit = _misfit(what, manifest, spec)
            if misfit:
                bad.append(FieldViolation(field, misfit))
            resolved.append(replace(use, version=manifest.version))
        if bad:
            raise InvalidArgument(bad)
        return tuple(resolved)

    async def _manifest(self, name: str, version: str) -> Manifest | None:
        key = (name, version)
        now = self._clock()
        cached = self._manifests.get(key)
        if cached is not None and now - cached[0] < (self._ttl_s if cached[1] is not None else ABSENT_TTL_S):
            return cached[1]
        manifest = await asyncio.to_thread(self._read, name, version)
        self._manifests[key] = (now, manifest)
        return manifest

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


def _misfit(what: str, manifest: Manifest, spec: ModelSpec) -> str:
    """Why the stored ``manifest`` cannot adapt ``spec``'s jobs; "" where it can."""
    entry = manifest.entry
    if entry.get("kind") != KIND:
        return f"{what!r} is a model, not an adapter"
    if entry.get("family") != spec.family:
        return f"{what!r} adapts {entry.get('family')} models; {spec.name!r} is a {spec.family} model"
    if int(entry.get("rank", 0)) > spec.adapter_rank:
        return f"{what!r} has rank {entry.get('rank')}; {spec.name!r} takes {spec.adapter_rank} at most"
    return ""


def store_of(settings: ModelStoreSettings) -> Callable[[], ObjectStore | None]:
    """The store's client where ``settings`` name one (a gateway is given the reader's identity)."""

    def make() -> ObjectStore | None:
        return ObjectStore.from_settings(settings) if settings.model_store_url else None

    return make
