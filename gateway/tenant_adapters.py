"""Tenants' own LoRA adapters, as the gateway keeps them: an upload checked before
anything is stored (its header against the limits, before a byte of the file is
read; the file as `darkroom models push --lora` checks one, in a process of its own:
``services.models.adapters.checking``), then its row reserved within its tenant's
limits, its bytes pushed under its tenant's prefix of the model store, and its row
marked stored; listing and removal of the caller's own. The store is written with
the gateway's own identity, which may write nothing but ``tenants/``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from gateway.adapter_files import FILE, Checked, check, check_framing, header_of, receive
from gateway.auth import Caller
from gateway.tenant_limits import refused
from services.config.sections import GatewaySettings
from services.db.adapter_records import AdapterLimits, AdapterRefusal, AdapterUsage, TenantAdapter
from services.db.repository import Repository
from services.errors import (
    AlreadyExists,
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    ModelError,
    NotFound,
    QuotaViolation,
    ResourceExhausted,
    StoreUnavailable,
)
from services.models.adapters.families import LORA_LOADERS
from services.models.registry import ModelRegistry
from services.models.spec import ModelSpec, store_reference
from services.models.store.errors import ModelNotInStore, ModelStoreError
from services.models.store.manifest import parse_reference, tenant_prefix, tenant_store_name
from services.models.store.objects import ObjectStore
from services.models.store.push import content_version, push_directory, scan_directory
from services.quotas import adapter_room
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

log = logging.getLogger(__name__)

# A tenant's adapter's name: a path segment of its own, without '.' (its store name
# is its tenant's scope, a '.', and it: ``tenant_store_name``).
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,47}$")
# An upload begun this long ago and never stored was cut off (its gateway died):
# another upload of the same bytes takes it over, and the tenant's next upload
# deletes what it left.
ABANDONED_AFTER = timedelta(minutes=10)
# Uploads a gateway receives and checks at once; the others wait their turn.
UPLOADS_AT_ONCE = 2


class TenantAdapters:
    def __init__(
        self,
        settings: GatewaySettings,
        repo: Repository,
        registry: ModelRegistry,
        store: Callable[[], ObjectStore | None],
        models_dir: Path,
    ) -> None:
        self.settings = settings
        self.repo = repo
        self.registry = registry
        self._make_store = store
        self._store: ObjectStore | None = None
        self.models_dir = models_dir
        self._uploads = asyncio.Semaphore(UPLOADS_AT_ONCE)

    def _the_store(self) -> ObjectStore:
        if self._store is None:
            self._store = self._make_store()
        if self._store is None:
            raise FailedPrecondition(
                "this gateway has no model store (DARKROOM_MODEL_STORE_URL and its own identity): it keeps no adapters"
            )
        return self._store

    def limits(self, caller: Caller) -> AdapterLimits:
        terms = caller.terms
        count = terms.max_adapters if terms and terms.max_adapters is not None else self.settings.tenant_adapters_max
        mb = terms.max_adapter_mb if terms and terms.max_adapter_mb is not None else self.settings.tenant_adapter_mb
        return AdapterLimits(count, int(mb * 2**20))

    # -- upload ------------------------------------------------------------------

    async def upload(
        self,
        caller: Caller,
        messages: AsyncIterator[pb.UploadAdapterRequest],
        accepted: Callable[[], Awaitable[None]],
    ) -> TenantAdapter:
        """The adapter kept; ``accepted`` is awaited once the header passed every
        check that needs no file, so a client may wait for it before sending the
        file (a refusal then never meets a write in flight)."""
        header = await header_of(messages)
        base = self._check_header(header)
        store = self._the_store()
        now = datetime.now(UTC)
        limits = self.limits(caller)
        if caller.terms is not None and caller.terms.rate_per_s is not None:
            refusal = await self.repo.admission.draw(caller.tenant, now)
            if refusal is not None:
                raise refused(refusal, None)
        network = await self._network_source(base, store)
        await accepted()
        async with self._uploads:
            scratch = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="darkroom-adapter-"))
            try:
                folder = scratch / "adapter"  # what is pushed: the file alone
                await asyncio.to_thread(folder.mkdir)
                await receive(messages, folder / FILE, header.size_bytes)
                version = content_version(await asyncio.to_thread(scan_directory, folder))
                kept = await self.repo.adapters.visible(caller.tenant, header.name, version)
                if kept is not None and kept.tenant == caller.tenant:
                    return kept  # the same bytes, uploaded before: neither checked nor stored again
                usage = await self.repo.adapters.usage(caller.tenant)
                self._check_room(caller.tenant, header.size_bytes, usage, limits)  # before the costly check
                await asyncio.to_thread(check_framing, folder / FILE)
                checked = await self._check_file(folder, scratch, base, network)
                new = TenantAdapter(
                    caller.tenant, header.name, version, str(base.family), base.name, checked.rank, checked.layers,
                    header.size_bytes, now, checked.skipped,
                )  # fmt: skip
                return await self._keep(new, store, folder, limits)
            finally:
                await asyncio.to_thread(shutil.rmtree, scratch, True)

    def _check_header(self, header: pb.AdapterUpload) -> ModelSpec:
        bad = []
        if not NAME.match(header.name):
            bad.append(FieldViolation("name", "letters, digits, '_' and '-' (at most 48), not starting with a sign"))
        base = self._base(header.base_model)
        if isinstance(base, FieldViolation):
            bad.append(base)
        largest = int(self.settings.max_adapter_mb * 2**20)
        if not 0 < header.size_bytes <= largest:
            why = f"{header.size_bytes} bytes; an adapter file is 1 to {largest} bytes (DARKROOM_MAX_ADAPTER_MB)"
            bad.append(FieldViolation("size_bytes", why))
        if bad:
            raise InvalidArgument(bad)
        assert isinstance(base, ModelSpec)
        return base

    def _base(self, name: str) -> ModelSpec | FieldViolation:
        base = self.registry.default_for("image") if not name else self.registry.models.get(name)
        if base is None:
            what = f"no model {name!r} in the registry" if name else "no default image model: name one"
            return FieldViolation("base_model", what)
        if not base.adapter_slots or base.family not in LORA_LOADERS:
            return FieldViolation("base_model", f"model {base.name!r} takes no adapters")
        return base

    def _check_room(self, tenant: str, size: int, usage: AdapterUsage, limits: AdapterLimits) -> None:
        """A look at the tenant's limits before the file is checked (its reservation decides)."""
        refusal = adapter_room(tenant, size, usage, limits)
        if refusal is not None:
            raise quota_refusal(refusal)

    async def _network_source(self, base: ModelSpec, store: ObjectStore) -> dict[str, Any]:
        """Where the check reads the base network's config from: a store model's
        manifest (which records it when pushed), else its builtin or directory."""
        stored = store_reference(base)
        if stored is None:
            return {"source": base.source, "models_dir": str(self.models_dir)}
        try:
            manifest = await asyncio.to_thread(store.read_manifest, *stored)
        except ModelNotInStore as exc:
            raise FailedPrecondition(f"the base model {base.name!r} is not in the model store: {exc}") from None
        except ModelStoreError as exc:
            raise StoreUnavailable(f"the model store cannot give {base.name}'s manifest now: {exc}") from exc
        network = f"{LORA_LOADERS[base.family][1]}/config.json"
        config = (manifest.entry.get("network_configs") or {}).get(network)
        if config is None:
            raise FailedPrecondition(
                f"{manifest.name}:{manifest.version} was pushed before pushes recorded its network's config: the "
                "operator pushes it again (`darkroom models push`) to take adapters uploaded for it"
            )
        return {"network_config": config}

    async def _check_file(self, folder: Path, scratch: Path, base: ModelSpec, network: dict[str, Any]) -> Checked:
        request = {"directory": str(folder), "family": str(base.family), "max_rank": base.adapter_rank, **network}
        return await check(request, scratch, self.settings.adapter_check_timeout_s)

    async def _keep(
        self, new: TenantAdapter, store: ObjectStore, directory: Path, limits: AdapterLimits
    ) -> TenantAdapter:
        """The checked file reserved, pushed and marked stored; the stored one of the
        same bytes where there is one already."""
        await self._forget_abandoned(new.tenant, store, new.created_at)
        stale_before = new.created_at - ABANDONED_AFTER
        reserved = await self.repo.adapters.reserve(new, limits, stale_before=stale_before)
        if isinstance(reserved, AdapterRefusal):
            raise quota_refusal(reserved)
        if not reserved.fresh:
            if reserved.adapter.stored:
                return reserved.adapter  # the same bytes, stored meanwhile: nothing more to do
            raise AlreadyExists(f"{new.reference} is being uploaded by another call: retry when it is done")
        entry = {
            "kind": "lora",
            "family": new.family,
            "base": new.base_model,
            "rank": new.rank,
            "layers": new.layers,
            "skipped": list(new.skipped),
            "tenant": new.tenant,
        }
        scoped = store.scoped(tenant_prefix(new.tenant))
        reference = f"{tenant_store_name(new.tenant, new.name)}:{new.version}"
        try:
            await asyncio.to_thread(push_directory, scoped, directory, reference, entry=entry)
        except (ModelError, OSError) as exc:
            log.warning("the model store did not take %s of %s: %s", new.reference, new.tenant, exc)
            await self.repo.adapters.discard(new)
            raise StoreUnavailable(f"the model store did not take {new.reference}: {exc}") from exc
        return await self.repo.adapters.stored(new)

    async def _forget_abandoned(self, tenant: str, store: ObjectStore, now: datetime) -> None:
        """What uploads cut off long ago left of ``tenant``'s: their bytes and rows."""
        for gone in await self.repo.adapters.abandoned(tenant, now - ABANDONED_AFTER):
            with contextlib.suppress(ModelError):
                await asyncio.to_thread(_remove_stored, store, gone)
            await self.repo.adapters.discard(gone)

    # -- listing and removal ------------------------------------------------------

    async def remove(self, caller: Caller, reference: str) -> list[TenantAdapter]:
        """Removes the caller's own ``NAME[:VERSION]``: its rows, then its bytes."""
        try:
            name, version = parse_reference(reference)
        except ModelError as exc:
            raise InvalidArgument([FieldViolation("name", str(exc))]) from None
        if not NAME.match(name):
            raise NotFound(f"no adapter {reference!r} of yours")
        store = self._the_store()
        removed = await self.repo.adapters.remove(caller.tenant, name, version)
        if not removed:
            raise NotFound(f"no adapter {reference!r} of yours")
        for adapter in removed:
            try:
                await asyncio.to_thread(_remove_stored, store, adapter)
            except ModelNotInStore:
                pass  # an upload cut off before its bytes were stored
            except ModelError as exc:
                raise StoreUnavailable(
                    f"{adapter.reference} is no longer yours to name; its bytes stay: {exc}"
                ) from exc
        return removed


def _remove_stored(store: ObjectStore, adapter: TenantAdapter) -> None:
    scoped = store.scoped(tenant_prefix(adapter.tenant))
    scoped.remove(tenant_store_name(adapter.tenant, adapter.name), adapter.version)


def quota_refusal(refusal: AdapterRefusal) -> ResourceExhausted:
    """RESOURCE_EXHAUSTED with a QuotaFailure; no RetryInfo: removing an adapter, or an operator, frees room."""
    return ResourceExhausted(
        f"{refusal.description} ({refusal.limit})",
        retry_after_s=None,
        quota=QuotaViolation(f"tenant:{refusal.tenant}", f"{refusal.limit}: {refusal.description}"),
    )
