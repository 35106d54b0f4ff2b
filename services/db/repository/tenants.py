"""Tenants and their API keys."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from services.api_keys import IssuedKey
from services.db.repository.database import Area
from services.db.tenant_records import TERMS, KeyHolder, KeyRecord, TenantRecord, TenantTerms
from services.errors import AlreadyExists, NotFound

_WRITTEN = ", ".join(("name", *TERMS, "created_at", "updated_at"))
_TENANT_COLUMNS = f"{_WRITTEN}, credits_day"
_KEY_COLUMNS = "id, tenant, admin, created_at, revoked_at"


class Tenants(Area):
    async def create(self, name: str, terms: TenantTerms, *, now: datetime) -> TenantRecord:
        row = await self.db.one(
            f"""
            INSERT INTO tenants ({_WRITTEN})
            VALUES (%(name)s, {", ".join(f"%({t})s" for t in TERMS)}, %(now)s, %(now)s)
            ON CONFLICT (name) DO NOTHING
            RETURNING {_TENANT_COLUMNS}
            """,
            {"name": name, "now": now, **{t: getattr(terms, t) for t in TERMS}},
        )
        if row is None:
            raise AlreadyExists(f"tenant {name!r} already exists")
        return TenantRecord.of(row)

    async def update(self, name: str, changes: Mapping[str, object], *, now: datetime) -> TenantRecord:
        """Sets the terms named in ``changes`` (the others, and credits moved by jobs
        since the caller read them, stay as they are)."""
        unknown = set(changes) - set(TERMS)
        if unknown:
            raise ValueError(f"not a tenant's term: {sorted(unknown)}")
        sets = "".join(f"{t} = %({t})s, " for t in changes)
        row = await self.db.one(
            f"""
            UPDATE tenants SET {sets}updated_at = %(now)s
            WHERE name = %(name)s RETURNING {_TENANT_COLUMNS}
            """,
            {"name": name, "now": now, **changes},
        )
        if row is None:
            raise NotFound(f"no tenant {name!r}")
        return TenantRecord.of(row)

    async def get(self, name: str) -> TenantRecord:
        row = await self.db.one(f"SELECT {_TENANT_COLUMNS} FROM tenants WHERE name = %s", (name,))
        if row is None:
            raise NotFound(f"no tenant {name!r}")
        return TenantRecord.of(row)

    async def find(self, name: str) -> TenantRecord | None:
        row = await self.db.one(f"SELECT {_TENANT_COLUMNS} FROM tenants WHERE name = %s", (name,))
        return TenantRecord.of(row) if row is not None else None

    async def all(self) -> list[TenantRecord]:
        return [TenantRecord.of(r) for r in await self.db.all(f"SELECT {_TENANT_COLUMNS} FROM tenants ORDER BY name")]

    async def any(self) -> bool:
        """Whether any tenant is defined: without one, the API is open."""
        row = await self.db.one("SELECT EXISTS (SELECT 1 FROM tenants) AS any")
        return bool(row and row["any"])

    async def add_key(self, tenant: str, issued: IssuedKey, *, admin: bool, now: datetime) -> KeyRecord:
        row = await self.db.one(
            f"""
            INSERT INTO api_keys (id, tenant, digest, admin, created_at)
            SELECT %(id)s, name, %(digest)s, %(admin)s, %(now)s FROM tenants WHERE name = %(tenant)s
            RETURNING {_KEY_COLUMNS}
            """,
            {"id": issued.id, "tenant": tenant, "digest": issued.digest, "admin": admin, "now": now},
        )
        if row is None:
            raise NotFound(f"no tenant {tenant!r}")
        return KeyRecord.of(row)

    async def keys(self, tenant: str) -> list[KeyRecord]:
        await self.get(tenant)
        rows = await self.db.all(
            f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE tenant = %s ORDER BY created_at, id", (tenant,)
        )
        return [KeyRecord.of(r) for r in rows]

    async def revoke(self, key_id: str, *, now: datetime) -> KeyRecord:
        """Revokes a key (again: no change); gateways refuse it from their next look."""
        row = await self.db.one(
            f"""
            UPDATE api_keys SET revoked_at = coalesce(revoked_at, %(now)s) WHERE id = %(id)s
            RETURNING {_KEY_COLUMNS}
            """,
            {"id": key_id, "now": now},
        )
        if row is None:
            raise NotFound(f"no key {key_id!r}")
        return KeyRecord.of(row)

    async def holder(self, key_id: str) -> KeyHolder | None:
        """The key with this id, its digest and its tenant; None if there is none."""
        row = await self.db.one(
            f"""
            SELECT k.id, k.tenant, k.admin, k.created_at AS key_created_at, k.revoked_at, k.digest,
                   {", ".join(f"t.{c}" for c in _TENANT_COLUMNS.split(", "))}
            FROM api_keys k JOIN tenants t ON t.name = k.tenant WHERE k.id = %s
            """,
            (key_id,),
        )
        if row is None:
            return None
        key = KeyRecord(row["id"], row["tenant"], row["admin"], row["key_created_at"], row["revoked_at"])
        return KeyHolder(key, row["digest"], TenantRecord.of(row))
