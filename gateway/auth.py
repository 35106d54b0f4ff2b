"""Who is calling: ``authorization: Bearer <key>`` metadata on every public call,
matched to a tenant's key in PostgreSQL or to a key of ``DARKROOM_API_KEYS`` (the
default tenant's). With neither tenants nor such keys the gateway is open, for
local use: every caller is the default tenant; only where open access is allowed
(``services.open_access``: loopback listeners, or ``DARKROOM_ALLOW_ANONYMOUS``),
else such a gateway does not start, and one whose tenants vanish refuses callers.

What a key's id finds is kept for ``RECHECK_S`` and then read again, so a key
revoked, or a tenant changed, is seen by every gateway within a second without a
read per call. A key not of the form keys are made in (``services.api_keys``) is
refused before any read, and nothing of it is remembered."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc

from gateway.metrics import count_refusal
from services import api_keys
from services.db.repository.tenants import Tenants
from services.db.tenant_records import DEFAULT_TENANT, TenantTerms
from services.errors import NotFound, Unauthenticated

log = logging.getLogger(__name__)

T = TypeVar("T")
E = TypeVar("E", bound=Exception)
RECHECK_S = 0.5
# Past this many remembered key ids, forgotten ones are dropped first.
_MAX_REMEMBERED = 100_000
_ASK_FOR_KEY = "missing or unknown API key: send `authorization: Bearer <key>`"


@dataclass(frozen=True)
class Caller:
    tenant: str
    key_id: str  # "" on an open gateway; "env" for a key of DARKROOM_API_KEYS
    admin: bool
    # The tenant's terms; None where it has no record (an open gateway, or the
    # default tenant never created): any lane, no limits.
    terms: TenantTerms | None
    peer: str = ""

    def own(self, method: str, job_id: str, found: T | None, owner: Callable[[T], str]) -> T:
        """What was found of the job if it is this caller's. Another tenant's job is
        not found, exactly as one that does not exist (and the attempt is logged)."""
        if found is not None and owner(found) == self.tenant:
            return found
        missing = NotFound(f"job {job_id} not found")
        if found is None:
            raise missing
        raise self.refused("cross_tenant", method, missing, job_id=job_id)

    def refused(self, reason: str, method: str, error: E, **about: object) -> E:
        """``error``, once the refusal is logged and counted."""
        count_refusal(reason, self.tenant)
        log.warning(
            "refused %s: %s",
            method,
            error,
            extra={"tenant": self.tenant, "key_id": self.key_id, "peer": self.peer, "method": method, **about},
        )
        return error


class _Recent(Generic[T]):
    """Values by name, each read again once it is RECHECK_S old."""

    def __init__(self, read: Callable[[str], Awaitable[T]], clock: Callable[[], float]) -> None:
        self._read = read
        self._clock = clock
        self._values: dict[str, tuple[float, T]] = {}

    async def get(self, name: str) -> T:
        now = self._clock()
        found = self._values.get(name)
        if found is not None and found[0] > now:
            return found[1]
        value = await self._read(name)
        if len(self._values) >= _MAX_REMEMBERED:
            self._values = {k: v for k, v in self._values.items() if v[0] > now}
        self._values[name] = (now + RECHECK_S, value)
        return value

    def __len__(self) -> int:
        return len(self._values)


class Gatekeeper:
    def __init__(
        self,
        tenants: Tenants,
        env_keys: Iterable[str],
        *,
        anonymous: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._env_keys = frozenset(env_keys)
        self._anonymous = anonymous  # whether it may be open at all (services.open_access)
        self._holders = _Recent(tenants.holder, clock)
        self._tenants = _Recent(tenants.find, clock)
        self._any_tenant = _Recent(lambda _: tenants.any(), clock)
        self._was_open: bool | None = None

    @property
    def remembered_keys(self) -> int:
        """How many key ids' holders (or their absence) are remembered now."""
        return len(self._holders)

    async def caller(self, context: grpc.aio.ServicerContext, method: str) -> Caller:
        """The caller of this call, or Unauthenticated (logged and counted)."""
        metadata = dict(context.invocation_metadata() or ())
        presented = str(metadata.get("authorization", ""))
        key = presented.removeprefix("Bearer ") if presented.startswith("Bearer ") else ""
        peer = context.peer()
        if key and key in self._env_keys:
            default = await self._tenants.get(DEFAULT_TENANT)
            return Caller(DEFAULT_TENANT, "env", True, default.terms if default else None, peer)
        if not self._env_keys and self._anonymous and await self._open():
            return Caller(DEFAULT_TENANT, "", True, None, peer)
        key_id = api_keys.key_id_of(key)  # None: not of the form keys are made in; looked up never
        holder = await self._holders.get(key_id) if key_id else None
        if holder is None or not api_keys.matches(key, holder.digest):
            stranger = Caller("", key_id or api_keys.shown_id(key), False, None, peer)
            raise stranger.refused("missing" if not key else "unknown", method, Unauthenticated(_ASK_FOR_KEY))
        if holder.key.revoked_at is not None:
            stranger = Caller(holder.tenant.name, holder.key.id, False, None, peer)
            raise stranger.refused("revoked", method, Unauthenticated(_ASK_FOR_KEY))
        return Caller(holder.tenant.name, holder.key.id, holder.key.admin, holder.tenant.terms, peer)

    async def _open(self) -> bool:
        is_open = not await self._any_tenant.get("")
        if is_open != self._was_open:
            if is_open:
                log.warning(
                    "no tenants are defined and DARKROOM_API_KEYS is empty: the API is open to anyone who can "
                    "reach it (local use); `darkroom tenants create` and `darkroom keys create` close it"
                )
            elif self._was_open is not None:
                log.info("tenants are defined: every call now needs an API key")
            self._was_open = is_open
        return is_open
