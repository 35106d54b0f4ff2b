"""What the repository takes and returns of tenants and their keys."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import date, datetime
from typing import Any

# The tenant of every job when no tenants are defined, and of the keys of
# DARKROOM_API_KEYS; it needs no row (one made under this name sets its terms).
DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class TenantTerms:
    """What a tenant may do: its lane and limits (None: no limit). ``credits`` is
    its credit balance (what its open jobs hold is apart: ``Credits.held``)."""

    lane: str
    credits: float | None = None
    daily_credits: float | None = None
    max_jobs: int | None = None
    rate_per_s: float | None = None
    weight: float = 1.0
    expand_prompts: bool = False  # its prompts are expanded unless a request says otherwise
    # What the image filter's flag does to its jobs' outputs ("block", "blur",
    # "flag"); None: its lane's (DARKROOM_OUTPUT_POLICIES).
    output_policy: str | None = None
    # Its own adapters: versions stored and their MB in all; None: the gateway's defaults.
    max_adapters: int | None = None
    max_adapter_mb: float | None = None


TERMS = tuple(f.name for f in fields(TenantTerms))


@dataclass(frozen=True)
class TenantRecord:
    name: str
    terms: TenantTerms
    created_at: datetime
    updated_at: datetime
    credits_day: date | None = None  # the UTC day its daily credits were last given

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> TenantRecord:
        terms = TenantTerms(**{t: row[t] for t in TERMS})
        return cls(row["name"], terms, row["created_at"], row["updated_at"], row["credits_day"])


@dataclass(frozen=True)
class KeyRecord:
    """A key as listed: never the key itself, which only its owner holds."""

    id: str
    tenant: str
    admin: bool
    created_at: datetime
    revoked_at: datetime | None = None

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> KeyRecord:
        return cls(row["id"], row["tenant"], row["admin"], row["created_at"], row["revoked_at"])


@dataclass(frozen=True)
class KeyHolder:
    """What a presented key's id finds: the key's digest to match it against, and
    its tenant as it stands."""

    key: KeyRecord
    digest: str
    tenant: TenantRecord


@dataclass(frozen=True)
class AdminAction:
    """A change to a tenant or its keys, as ``admin_actions`` records it."""

    at: datetime
    actor: str  # the user and host the command ran as
    action: str  # e.g. "keys revoke"
    tenant: str
    key_id: str | None
    detail: str  # the terms set, or a key's role; never a key


@dataclass(frozen=True)
class TenantShare:
    """A tenant's weight, and its GPU-seconds decayed as of ``used_at`` (None:
    nothing used yet)."""

    tenant: str
    weight: float = 1.0
    used_s: float = 0.0
    used_at: datetime | None = None

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> TenantShare:
        return cls(row["tenant"], row["weight"], row["used_s"], row["used_at"])


# The kinds of entry in a tenant's credit ledger (``credit_entries``).
INITIAL = "initial"  # the balance it was made with
ADJUST = "adjust"  # an operator's change: --credits (to N, or none) or --add-credits
TOP_UP = "top_up"  # its daily credits
CHARGE = "charge"  # a settled job's cost (negative)


@dataclass(frozen=True)
class CreditEntry:
    """One movement of a tenant's credit balance; the balance is the sum of them."""

    tenant: str
    at: datetime
    kind: str  # INITIAL, ADJUST, TOP_UP or CHARGE
    amount: float  # signed
    job_id: str | None = None  # the job a CHARGE settled

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> CreditEntry:
        return cls(row["tenant"], row["at"], row["kind"], row["amount"], row["job_id"])


@dataclass(frozen=True)
class OpenJobs:
    """A tenant's jobs not yet settled: those queued or running, and the credits
    all of them hold (ended jobs hold theirs until they are settled)."""

    active: int = 0
    held: float = 0.0
