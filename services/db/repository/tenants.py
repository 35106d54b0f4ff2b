"""Tenants and their API keys. Every change is recorded in ``admin_actions``, in
the transaction that makes it: who (``actor``), what, to which tenant and key."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from psycopg import AsyncConnection
from psycopg.rows import DictRow

from services.api_keys import IssuedKey
from services.db.repository.database import Area, fetch_all
from services.db.tenant_records import TERMS, AdminAction, KeyHolder, KeyRecord, TenantRecord, TenantTerms
from services.errors import AlreadyExists, NotFound

_WRITTEN = ", ".join(("name", *TERMS, "created_at", "updated_at"))
_TENANT_COLUMNS = f"{_WRITTEN}, credits_day"
_KEY_COLUMNS = "id, tenant, admin, created_at, revoked_at"
_AUDIT = """
INSERT INTO admin_actions (at, actor, action, tenant, key_id, detail)
VALUES (%(now)s, %(actor)s, %(action)s, %(tenant)s, %(key_id)s, %(detail)s)
"""


async def _one(conn: AsyncConnection[DictRow], sql: str, params: Mapping[str, object]) -> DictRow | None:
    rows = await fetch_all(conn, sql, dict(params))
    return rows[0] if rows else None


class Tenants(Area):
    async def create(self, name: str, terms: TenantTerms, *, actor: str, now: datetime) -> TenantRecord:
        values = {t: getattr(terms, t) for t in TERMS}
        async with self.db.tx() as conn:
            row = await _one(
                conn,
                f"""
                INSERT INTO tenants ({_WRITTEN})
                VALUES (%(name)s, {", ".join(f"%({t})s" for t in TERMS)}, %(now)s, %(now)s)
                ON CONFLICT (name) DO NOTHING
                RETURNING {_TENANT_COLUMNS}
                """,
                {"name": name, "now": now, **values},
            )
            if row is None:
                raise AlreadyExists(f"tenant {name!r} already exists")
            await self._record(conn, actor, "tenants create", name, None, _terms_text(values), now)
        return TenantRecord.of(row)

    async def update(self, name: str, changes: Mapping[str, object], *, actor: str, now: datetime) -> TenantRecord:
        """Sets the terms named in ``changes`` (the others, and credits moved by jobs
        since the caller read them, stay as they are)."""
        unknown = set(changes) - set(TERMS)
        if unknown:
            raise ValueError(f"not a tenant's term: {sorted(unknown)}")
        sets = "".join(f"{t} = %({t})s, " for t in changes)
        async with self.db.tx() as conn:
            row = await _one(
                conn,
                f"""
                UPDATE tenants SET {sets}updated_at = %(now)s
                WHERE name = %(name)s RETURNING {_TENANT_COLUMNS}
                """,
                {"name": name, "now": now, **changes},
            )
            if row is None:
                raise NotFound(f"no tenant {name!r}")
            await self._record(conn, actor, "tenants update", name, None, _terms_text(changes), now)
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

    async def add_key(self, tenant: str, issued: IssuedKey, *, admin: bool, actor: str, now: datetime) -> KeyRecord:
        async with self.db.tx() as conn:
            row = await _one(
                conn,
                f"""
                INSERT INTO api_keys (id, tenant, digest, admin, created_at)
                SELECT %(id)s, name, %(digest)s, %(admin)s, %(now)s FROM tenants WHERE name = %(tenant)s
                RETURNING {_KEY_COLUMNS}
                """,
                {"id": issued.id, "tenant": tenant, "digest": issued.digest, "admin": admin, "now": now},
            )
            if row is None:
                raise NotFound(f"no tenant {tenant!r}")
            role = "admin" if admin else "tenant"
            await self._record(conn, actor, "keys create", tenant, issued.id, f"role={role}", now)
        return KeyRecord.of(row)

    async def keys(self, tenant: str) -> list[KeyRecord]:
        await self.get(tenant)
        rows = await self.db.all(
            f"SELECT {_KEY_COLUMNS} FROM api_keys WHERE tenant = %s ORDER BY created_at, id", (tenant,)
        )
        return [KeyRecord.of(r) for r in rows]

    async def revoke(self, key_id: str, *, actor: str, now: datetime) -> KeyRecord:
        """Revokes a key (again: no change); gateways refuse it from their next look."""
        async with self.db.tx() as conn:
            row = await _one(
                conn,
                f"""
                UPDATE api_keys SET revoked_at = coalesce(revoked_at, %(now)s) WHERE id = %(id)s
                RETURNING {_KEY_COLUMNS}
                """,
                {"id": key_id, "now": now},
            )
            if row is None:
                raise NotFound(f"no key {key_id!r}")
            await self._record(conn, actor, "keys revoke", row["tenant"], key_id, "", now)
        return KeyRecord.of(row)

    async def actions(self, tenant: str, *, limit: int = 20) -> list[AdminAction]:
        """The latest admin actions on the tenant and its keys, newest first."""
        rows = await self.db.all(
            """
            SELECT at, actor, action, tenant, key_id, detail FROM admin_actions
            WHERE tenant = %s ORDER BY at DESC, id DESC LIMIT %s
            """,
            (tenant, limit),
        )
        return [AdminAction(**row) for row in rows]

    async def _record(
        self,
        conn: AsyncConnection[DictRow],
        actor: str,
        action: str,
        tenant: str,
        key_id: str | None,
        detail: str,
        now: datetime,
    ) -> None:
        await conn.execute(
            _AUDIT,
            {"now": now, "actor": actor, "action": action, "tenant": tenant, "key_id": key_id, "detail": detail},
        )

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


def _terms_text(terms: Mapping[str, object]) -> str:
    return ", ".join(f"{name}={value}" for name, value in terms.items())
