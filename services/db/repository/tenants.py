"""Tenants and their API keys. Every change is recorded in ``admin_actions``, in
the transaction that makes it: who (``actor``), what, to which tenant and key; a
change to a tenant's credit balance is an entry of its ledger there too."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from psycopg import AsyncConnection
from psycopg.rows import DictRow

from services.api_keys import IssuedKey
from services.db.repository.credits import record
from services.db.repository.database import Area, fetch_all
from services.db.tenant_records import (
    ADJUST,
    INITIAL,
    TERMS,
    AdminAction,
    CreditEntry,
    KeyHolder,
    KeyRecord,
    TenantRecord,
    TenantTerms,
)
from services.errors import AlreadyExists, FieldViolation, InvalidArgument, NotFound

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
            if terms.credits:
                await record(conn, [CreditEntry(name, now, INITIAL, terms.credits)])
            await self._record(conn, actor, "tenants create", name, None, _terms_text(values), now)
        return TenantRecord.of(row)

    async def update(
        self,
        name: str,
        changes: Mapping[str, object],
        *,
        add_credits: float | None = None,
        actor: str,
        now: datetime,
    ) -> TenantRecord:
        """Sets the terms named in ``changes`` (the others stay as they are).
        ``credits`` sets the balance: what the tenant's open jobs hold stays held
        against it, and what they use is charged to it. ``add_credits`` adds to the
        balance (negative: takes away), for a tenant with a credit limit. Either is
        an entry of the tenant's ledger, of the difference it makes."""
        unknown = set(changes) - set(TERMS)
        if unknown:
            raise ValueError(f"not a tenant's term: {sorted(unknown)}")
        if add_credits is not None and "credits" in changes:
            raise ValueError("credits are set or added to, not both")
        sets = [f"{t} = %({t})s" for t in changes]
        if add_credits is not None:
            sets.append("credits = t.credits + %(add_credits)s")
        async with self.db.tx() as conn:
            # The row locked before it changes: the balance it had is the one moved.
            row = await _one(
                conn,
                f"""
                WITH old AS (SELECT name, credits FROM tenants WHERE name = %(name)s FOR UPDATE)
                UPDATE tenants t SET {"".join(f"{s}, " for s in sets)}updated_at = %(now)s
                FROM old WHERE t.name = old.name
                RETURNING {_qualified("t")}, old.credits AS old_credits
                """,
                {"name": name, "now": now, "add_credits": add_credits, **changes},
            )
            if row is None:
                raise NotFound(f"no tenant {name!r}")
            if add_credits is not None and row["old_credits"] is None:
                why = f"tenant {name!r} has no credit limit: set its credits first"
                raise InvalidArgument([FieldViolation("add_credits", why)])
            moved = add_credits if add_credits is not None else (row["credits"] or 0.0) - (row["old_credits"] or 0.0)
            if moved:
                await record(conn, [CreditEntry(name, now, ADJUST, moved)])
            done = {**changes, **({"add_credits": add_credits} if add_credits is not None else {})}
            await self._record(conn, actor, "tenants update", name, None, _terms_text(done), now)
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


def _qualified(alias: str) -> str:
    return ", ".join(f"{alias}.{column}" for column in _TENANT_COLUMNS.split(", "))


def _terms_text(terms: Mapping[str, object]) -> str:
    return ", ".join(f"{name}={value}" for name, value in terms.items())
