"""API keys: how one is made, and how a presented one is matched to its stored
digest. A key reads ``drk_<id>_<secret>``: the id finds its row without a scan, the
secret (256 random bits) is what proves it; only the SHA-256 of the whole key is
stored. A plain hash suffices: the secret is random, not a password to be guessed.
A presented key of any other form than the one ``new_key`` makes (16 hex digits of
id, 43 URL-safe characters of secret) names no id: nothing is looked up for it."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

PREFIX = "drk_"
_ID_BYTES = 8  # 16 hex digits
_SECRET_CHARS = 43  # token_urlsafe(32): 32 bytes in unpadded URL-safe base64
ID_CHARS = 2 * _ID_BYTES
KEY_CHARS = len(PREFIX) + ID_CHARS + 1 + _SECRET_CHARS
_FORM = re.compile(rf"{PREFIX}([0-9a-f]{{{ID_CHARS}}})_[A-Za-z0-9_-]{{{_SECRET_CHARS}}}")


@dataclass(frozen=True)
class IssuedKey:
    id: str
    key: str  # shown to its owner once, never stored

    @property
    def digest(self) -> str:
        return digest(self.key)


def new_key() -> IssuedKey:
    key_id = secrets.token_hex(_ID_BYTES)
    return IssuedKey(key_id, f"{PREFIX}{key_id}_{secrets.token_urlsafe(32)}")


def key_id_of(key: str) -> str | None:
    """The id a presented key names, or None if it is not of the form ``new_key``
    makes (its length checked first: a key of any size costs no more)."""
    found = _FORM.fullmatch(key) if len(key) == KEY_CHARS else None
    return found.group(1) if found else None


def shown_id(key: str) -> str:
    """What a log may show of a presented key that names no id: what follows the
    prefix up to its first ``_``, at most an id's length of it (never a character
    past that ``_``); "" for a key without the prefix."""
    if not key.startswith(PREFIX):
        return ""
    return key[len(PREFIX) :].partition("_")[0][:ID_CHARS]


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def matches(key: str, stored_digest: str) -> bool:
    return hmac.compare_digest(digest(key), stored_digest)
