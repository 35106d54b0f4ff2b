"""What the repository takes and returns of tenants' own LoRA adapters
(``tenant_adapters``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

# The limits a tenant's own adapters are held to, as a refusal names them.
MAX_ADAPTERS = "max_adapters"
MAX_ADAPTER_MB = "max_adapter_mb"


@dataclass(frozen=True)
class TenantAdapter:
    """One version of a tenant's adapter. ``stored`` is false while its upload is
    under way; ``published``: every tenant may name it."""

    tenant: str
    name: str
    version: str
    family: str
    base_model: str
    rank: int
    layers: int
    size_bytes: int
    created_at: datetime
    skipped: tuple[str, ...] = ()
    stored: bool = False
    published: bool = False

    @property
    def reference(self) -> str:
        return f"{self.name}:{self.version}"

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> TenantAdapter:
        skipped = tuple(s for s in row["skipped"].split(",") if s)
        return cls(
            row["tenant"],
            row["name"],
            row["version"],
            row["family"],
            row["base_model"],
            row["rank"],
            row["layers"],
            row["size_bytes"],
            row["created_at"],
            skipped,
            row["stored"],
            row["published"],
        )


@dataclass(frozen=True)
class AdapterLimits:
    """What a tenant may keep of its own adapters: versions, and their bytes in all."""

    max_adapters: int
    max_bytes: int


@dataclass(frozen=True)
class AdapterUsage:
    """What a tenant keeps of its own adapters (uploads under way included)."""

    adapters: int = 0
    size_bytes: int = 0


@dataclass(frozen=True)
class AdapterRefusal:
    """Why an upload does not fit its tenant's limits: the limit, and where the
    tenant stands against it."""

    tenant: str
    limit: str  # MAX_ADAPTERS or MAX_ADAPTER_MB
    description: str


@dataclass(frozen=True)
class Reserved:
    """An upload's row: made now (``fresh``: the upload goes on), or one already
    there of the same bytes (stored: the upload is done already; not stored: another
    upload of them is under way)."""

    adapter: TenantAdapter
    fresh: bool
