"""When the API may be open: with no tenant defined and ``DARKROOM_API_KEYS`` empty,
every caller is an admin of the default tenant. That is what a laptop's `darkroom
up` wants, and only there: open access is allowed while every public listener (the
gateway's gRPC port, the HTTP API's port) is on a loopback address, or where the
operator says so with ``DARKROOM_ALLOW_ANONYMOUS=true``. Elsewhere a gateway with
neither tenants nor keys refuses to start (``refusal``), naming the fix.

The gateway and ``darkroom up`` both decide here: the HTTP API is the gateway's
client and is as open as the gateway it calls, so the gateway counts the HTTP API's
listener as well, as ``DARKROOM_HTTP_HOST`` in its environment says (``darkroom up``
gives the gateway that one of the HTTP API's settings: services/ops/children.py)."""

from __future__ import annotations

import ipaddress
import socket

from services.config.http import HttpSettings
from services.config.sections import GatewaySettings


def is_loopback(host: str) -> bool:
    """Whether a listener bound to ``host`` is reachable from this machine only: a
    loopback address, or a name whose every address is one. Empty (every
    interface), a wildcard, or a name that does not resolve: no."""
    host = host.strip().strip("[]")
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    addresses = {str(info[4][0]) for info in found}
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def public_hosts(gateway: GatewaySettings, http: HttpSettings) -> list[str]:
    """Where the public listeners are bound: the gateway's and the HTTP API's."""
    return [gateway.host, http.host]


def anonymous_allowed(gateway: GatewaySettings, http: HttpSettings) -> bool:
    """Whether the API may be open (no tenants, no keys): the operator said so, or
    no public listener is reachable from another machine."""
    return gateway.allow_anonymous or all(is_loopback(h) for h in public_hosts(gateway, http))


def refusal(gateway: GatewaySettings, http: HttpSettings, *, tenants_exist: bool) -> str | None:
    """Why a gateway with these settings must not start, or None: it would be open
    (no tenants, no ``DARKROOM_API_KEYS``) on a listener off the loopback."""
    if tenants_exist or gateway.api_keys or anonymous_allowed(gateway, http):
        return None
    exposed = ", ".join(
        f"{name} {host or '(every interface)'}"
        for name, host in zip(("DARKROOM_GATEWAY_HOST", "DARKROOM_HTTP_HOST"), public_hosts(gateway, http), strict=True)
        if not is_loopback(host)
    )
    return (
        f"the API would be open to anyone who can reach it: no tenant is defined and DARKROOM_API_KEYS is empty, "
        f"and it listens off the loopback ({exposed}). Create a tenant and a key (`darkroom tenants create NAME "
        f"--lane LANE`, then `darkroom keys create NAME --admin`), or set DARKROOM_API_KEYS to an admin key, or "
        f"set DARKROOM_ALLOW_ANONYMOUS=true to keep it open on purpose"
    )
