"""Mutual TLS for the internal gRPC servers and channels, and the role check.

A service of the fleet presents its role's certificate both ways: as a server
(the client checks the name it dialled against the certificate's hosts) and as a
client (the server checks the certificate is the fleet CA's, then reads the role
from its common name). Renewed files are picked up without a restart: a server
asks for its certificate at each new handshake (``dynamic_ssl_server_credentials``)
and a client's channels are reopened once the files have changed."""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.mesh.pki import CertPaths, PkiError, check_role
from services.rpc.handlers import rewrapped
from services.telemetry.metrics import MESH_REFUSALS

log = logging.getLogger(__name__)

# How often a client looks at its certificate files' times, for a renewal.
RENEWAL_CHECK_S = 5.0


@dataclass(frozen=True)
class MeshIdentity:
    """This process's role, and where its certificate, key and the CA lie."""

    mesh_dir: Path
    role: str

    def __post_init__(self) -> None:
        check_role(self.role)

    @classmethod
    def of(cls, mesh_dir: str | Path, role: str) -> MeshIdentity | None:
        """The identity in ``mesh_dir``; None where the mesh is open (no directory)."""
        return cls(Path(mesh_dir), role) if str(mesh_dir) else None

    @property
    def paths(self) -> CertPaths:
        return CertPaths.of(self.mesh_dir, self.role)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Requires a client certificate from the fleet's CA; the files are read
        again at the next handshake after they change."""
        paths = self.paths

        def configuration() -> Any:
            ca, cert, key = paths.read()
            return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

        return _reloading(paths.mtimes, configuration, what=f"the {self.role}'s certificate", client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca, cert, key = self.paths.read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def public_server_credentials(cert_path: Path, key_path: Path) -> grpc.ServerCredentials:
    """TLS for the public gateway: its own certificate (any CA's), no client
    certificate asked for (API keys say who calls); renewed files are served from
    the next handshake on."""

    def mtimes() -> tuple[float, ...]:
        try:
            return (cert_path.stat().st_mtime, key_path.stat().st_mtime)
        except OSError:
            return (0.0, 0.0)

    def configuration() -> Any:
        try:
            pair = [(key_path.read_bytes(), cert_path.read_bytes())]
        except OSError as exc:
            raise PkiError(f"cannot read the gateway's TLS certificate or key: {exc}") from exc
        return grpc.ssl_server_certificate_configuration(pair)

    return _reloading(mtimes, configuration, what="the gateway's certificate", client_auth=False)


def _reloading(
    mtimes: Callable[[], tuple[float, ...]], configuration: Callable[[], Any], *, what: str, client_auth: bool
) -> grpc.ServerCredentials:
    """Server credentials that read ``configuration`` again at the first handshake
    after the files' ``mtimes`` change; a renewal that cannot be read (half
    written) leaves the current one in place, and is tried again at the next."""
    loaded = [mtimes()]
    first = configuration()
    lock = threading.Lock()

    def renewed() -> Any:
        # Called by gRPC's own threads at each handshake: None keeps the current one.
        with lock:
            now = mtimes()
            if now == loaded[0]:
                return None
            try:
                fresh = configuration()
            except Exception as exc:
                log.warning("%s, renewed, not loaded: %s", what, exc)
                return None
            loaded[0] = now
            log.info("serving with %s, renewed", what)
            return fresh

    return grpc.dynamic_ssl_server_credentials(first, renewed, require_client_authentication=client_auth)


def peer_role(context: grpc.aio.ServicerContext) -> str:
    """The role in the caller's certificate ("" without one)."""
    names = context.auth_context().get("x509_common_name") or []
    return names[0].decode(errors="replace") if names else ""


class RoleGuard(grpc.aio.ServerInterceptor):
    """Lets a method be called only by the roles ``allowed`` names for its service
    (its full name, ``package.Service``), or for the method itself
    (``/package.Service/Method``); a service it does not name (health checking,
    reflection) is open to every certificate of the fleet, which TLS has already
    checked. A refusal is ``PERMISSION_DENIED``, logged and counted. (The internal
    services' methods take one request: unary, or a stream of responses.)"""

    def __init__(self, allowed: Mapping[str, frozenset[str]], *, service: str) -> None:
        self.allowed = dict(allowed)
        self.service = service

    def _roles(self, method: str) -> frozenset[str] | None:
        if method in self.allowed:
            return self.allowed[method]
        return self.allowed.get(method.lstrip("/").rpartition("/")[0])

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        roles = self._roles(details.method)
        if handler is None or roles is None:
            return handler
        method = details.method

        def guarded(behavior: Callable[..., Any]) -> Callable[..., Any]:
            if inspect.isasyncgenfunction(behavior):

                async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                    await self._check(roles, method, context)
                    async for response in behavior(request, context):
                        yield response

                return streaming

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await self._check(roles, method, context)
                return await behavior(request, context)

            return unary

        return rewrapped(handler, guarded)

    async def _check(self, roles: frozenset[str], method: str, context: grpc.aio.ServicerContext) -> None:
        role = peer_role(context)
        if role in roles:
            return
        MESH_REFUSALS.labels(service=self.service, reason="role").inc()
        log.warning(
            "refused %s from %s: role %r may not call it",
            method,
            context.peer(),
            role,
            extra={"peer": context.peer(), "method": method, "role": role, "audit": True},
        )
        await context.abort(
            grpc.StatusCode.PERMISSION_DENIED, f"a {role or 'certificate-less'} caller may not call {method}"
        )


class ChannelCredentialsCache:
    """A client's credentials, read again once its certificate files change (a
    renewal), looked at no more often than every ``RENEWAL_CHECK_S``."""

    def __init__(self, identity: MeshIdentity, clock: Callable[[], float] = time.monotonic) -> None:
        self.identity, self.clock = identity, clock
        self._mtimes = identity.paths.mtimes()
        self._credentials = identity.channel_credentials()
        self._checked_at = clock()

    def renewed(self) -> bool:
        """True once after the files change: channels made before must be reopened."""
        now = self.clock()
        if now - self._checked_at < RENEWAL_CHECK_S:
            return False
        self._checked_at = now
        mtimes = self.identity.paths.mtimes()
        if mtimes == self._mtimes:
            return False
        try:
            self._credentials = self.identity.channel_credentials()
        except Exception as exc:
            log.warning("renewed certificates for %s not loaded: %s", self.identity.role, exc)
            return False
        self._mtimes = mtimes
        log.info("calling with renewed certificates for %s", self.identity.role)
        return True

    @property
    def credentials(self) -> grpc.ChannelCredentials:
        return self._credentials
