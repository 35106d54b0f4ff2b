"""A presented key is held to the form ``new_key`` makes before anything is looked
up: a key of any other length or alphabet is refused without a read, is not
remembered, and is logged by a bounded id (issue 41)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from gateway.auth import Gatekeeper
from services import api_keys
from services.db.tenant_records import KeyHolder
from services.errors import Unauthenticated
from tests.unit.test_tenancy import Clock, Table, call


@dataclass
class Holders(Table):
    """The table, recording each key id looked up."""

    asked: list[str] = field(default_factory=list)

    async def holder(self, key_id: str) -> KeyHolder | None:
        self.asked.append(key_id)
        return await super().holder(key_id)


def test_only_the_form_new_key_makes_names_an_id() -> None:
    issued = api_keys.new_key()
    assert api_keys.key_id_of(issued.key) == issued.id
    secret = issued.key[len(f"drk_{issued.id}_") :]
    for malformed in (
        "drk_" + "a" * 8192 + "_secret",  # any length of id
        issued.key + "x",  # a secret too long
        issued.key[:-1],  # or too short
        f"drk_ABCDEF0123456789_{secret}",  # an id of upper-case hex
        f"drk_{'g' * 16}_{secret}",  # or not hex at all
        f"drk_{issued.id}_{secret[:-1]}!",  # a character no secret has
        f"DRK_{issued.id}_{secret}",
    ):
        assert api_keys.key_id_of(malformed) is None, malformed[:40]


def test_a_malformed_key_is_refused_without_a_lookup_and_forgotten(caplog: pytest.LogCaptureFixture) -> None:
    table = Holders()
    cats = table.add("cats", "free")
    gate = Gatekeeper(table, (), clock=Clock())  # type: ignore[arg-type]
    huge = "drk_" + "a" * 8192 + "_secret"
    with caplog.at_level(logging.WARNING, logger="gateway.auth"), pytest.raises(Unauthenticated):
        call(gate, huge)
    assert table.asked == []
    assert gate.remembered_keys == 0
    [refusal] = [r for r in caplog.records if r.getMessage().startswith("refused GetJob")]
    assert len(refusal.key_id) <= 16  # type: ignore[attr-defined]
    # A well-formed key that no tenant holds: looked up, refused as before.
    unknown = api_keys.new_key()
    with pytest.raises(Unauthenticated):
        call(gate, unknown.key)
    assert table.asked == [unknown.id] and gate.remembered_keys == 1
    assert call(gate, cats).tenant == "cats"
