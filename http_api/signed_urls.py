"""Links to a job's outputs that whoever holds them may fetch until they expire:
the job, the output's index and the expiry, signed with HMAC-SHA256 under a key
every HTTP replica shares. Pure: the clock is passed in."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from pathlib import Path

KEY_BYTES = 32
# A link's expiry (seconds since the epoch) and signature (hex) as this signer writes them, with room.
MAX_EXPIRY_DIGITS = 12
MAX_SIGNATURE_CHARS = 128
_HEX = frozenset("0123456789abcdefABCDEF")


def malformed(expires: str, signature: str) -> tuple[str, str] | None:
    """The parameter of a link that no signer writes, and why; None when both are
    well formed (whether they match is ``UrlSigner.refusal``'s question)."""
    if not (0 < len(expires) <= MAX_EXPIRY_DIGITS and expires.isascii() and expires.isdigit()):
        return "expires", f"expires must be at most {MAX_EXPIRY_DIGITS} digits 0-9 (seconds since the epoch)"
    if not 0 < len(signature) <= MAX_SIGNATURE_CHARS or not set(signature) <= _HEX:
        return "signature", f"signature must be at most {MAX_SIGNATURE_CHARS} hexadecimal digits"
    return None


@dataclass(frozen=True)
class UrlSigner:
    key: bytes
    ttl_s: float

    def _signature(self, job_id: str, index: int, expires: int) -> str:
        message = f"{job_id}/{index}/{expires}".encode()
        return hmac.new(self.key, message, hashlib.sha256).hexdigest()

    def path(self, job_id: str, index: int, now: float) -> str:
        """The path and query of a link to output ``index`` of ``job_id``, good until ``now + ttl_s``."""
        expires = int(now + self.ttl_s)
        return f"/v1/files/{job_id}/{index}?expires={expires}&signature={self._signature(job_id, index, expires)}"

    def refusal(self, job_id: str, index: int, expires: str, signature: str, now: float) -> str:
        """Why a link may not be followed now; empty when it may."""
        bad = malformed(expires, signature)
        if bad is not None:
            return bad[1]
        if not hmac.compare_digest(signature, self._signature(job_id, index, int(expires))):
            return "the link's signature does not match"
        if int(expires) < now:
            return "the link has expired"
        return ""


def load_key(path: str) -> bytes:
    """The key in ``path``, or (empty path) a new one: its links are good on this process alone."""
    if not path:
        return secrets.token_bytes(KEY_BYTES)
    key = Path(path).read_bytes().strip()
    if len(key) < 16:
        raise ValueError(f"{path}: a link key of at least 16 bytes is needed, not {len(key)}")
    return key
