"""API keys: how one is made, and how a presented one is matched to its stored
digest. A key reads ``drk_<id>_<secret>``: the id finds its row without a scan, the
secret (256 random bits) is what proves it; only the SHA-256 of the whole key is
stored. A plain hash suffices: the secret is random, not a password to be guessed."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

PREFIX = "drk_"


@dataclass(frozen=True)
class IssuedKey:
    id: str
    key: str  # shown to its owner once, never stored

    @property
    def digest(self) -> str:
        return digest(self.key)


def new_key() -> IssuedKey:
    key_id = secrets.token_hex(8)
    return IssuedKey(key_id, f"{PREFIX}{key_id}_{secrets.token_urlsafe(32)}")


def key_id_of(key: str) -> str | None:
    """The id a presented key names, or None if it is not of Darkroom's form."""
    if not key.startswith(PREFIX):
        return None
    key_id, sep, secret = key[len(PREFIX) :].partition("_")
    return key_id if sep and key_id and secret else None


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def matches(key: str, stored_digest: str) -> bool:
    return hmac.compare_digest(digest(key), stored_digest)
