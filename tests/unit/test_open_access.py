"""When the API may be open (no tenants, no keys): only while every public listener
is on the loopback, or where the operator allows it (services/open_access.py); a
gatekeeper that may not be open refuses callers without a key."""

from __future__ import annotations

import pytest

from gateway.auth import Gatekeeper
from services.config.http import HttpSettings
from services.config.sections import GatewaySettings
from services.errors import Unauthenticated
from services.open_access import anonymous_allowed, is_loopback, refusal
from tests.unit.test_tenancy import Clock, Table, call


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.53", "::1", "[::1]", "localhost", "api.localhost"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["", "0.0.0.0", "::", "10.0.0.7", "192.168.1.20", "fe80::1", "no-such-host.invalid"])
def test_hosts_reachable_from_elsewhere_or_unknown(host: str) -> None:
    assert not is_loopback(host)


def test_open_only_while_every_public_listener_is_on_the_loopback() -> None:
    local, everywhere = GatewaySettings(), GatewaySettings(host="0.0.0.0")
    assert anonymous_allowed(local, HttpSettings())
    assert not anonymous_allowed(everywhere, HttpSettings())
    assert not anonymous_allowed(local, HttpSettings(host="0.0.0.0"))  # the HTTP API calls this gateway
    assert anonymous_allowed(GatewaySettings(host="0.0.0.0", allow_anonymous=True), HttpSettings(host="0.0.0.0"))


def test_an_open_gateway_off_the_loopback_is_refused_naming_every_fix() -> None:
    why = refusal(GatewaySettings(host="10.0.0.7"), HttpSettings(host="0.0.0.0"), tenants_exist=False)
    assert why is not None
    for fix in (
        "DARKROOM_ALLOW_ANONYMOUS=true",
        "darkroom tenants create",
        "darkroom keys create",
        "DARKROOM_API_KEYS",
    ):
        assert fix in why
    assert "DARKROOM_GATEWAY_HOST 10.0.0.7" in why and "DARKROOM_HTTP_HOST 0.0.0.0" in why


def test_a_tenant_a_key_or_the_operators_word_lets_it_start() -> None:
    exposed, http = GatewaySettings(host="0.0.0.0"), HttpSettings(host="0.0.0.0")
    assert refusal(exposed, http, tenants_exist=True) is None
    assert refusal(GatewaySettings(host="0.0.0.0", api_keys=("s3cret",)), http, tenants_exist=False) is None
    assert refusal(GatewaySettings(host="0.0.0.0", allow_anonymous=True), http, tenants_exist=False) is None
    assert refusal(GatewaySettings(), HttpSettings(), tenants_exist=False) is None


def test_a_gatekeeper_that_may_not_be_open_wants_a_key_even_without_tenants() -> None:
    table = Table()
    gate = Gatekeeper(table, (), anonymous=False, clock=Clock())  # type: ignore[arg-type]
    for key in (None, "anything"):
        with pytest.raises(Unauthenticated):
            call(gate, key)
    assert table.reads == 0 or table.tenants == {}
    cats = table.add("cats", "free")
    assert call(gate, cats).tenant == "cats"
