"""Tenants' own LoRA adapters: an upload reserves its row within its tenant's
limits (the tenant's uploads decided in turn, under a lock of its own, so that
concurrent uploads never pass them), is marked stored once its bytes are in the
model store, and is then named by its tenant's jobs, or by every tenant's once an
operator publishes it."""

from __future__ import annotations

from datetime import datetime

from psycopg import AsyncConnection
from psycopg.rows import DictRow

from services.db.adapter_records import (
    AdapterLimits,
    AdapterRefusal,
    AdapterUsage,
    Reserved,
    TenantAdapter,
)
from services.db.repository.database import Area, fetch_all, fetch_one
from services.errors import AlreadyExists, NotFound
from services.quotas import adapter_room

_COLUMNS = "tenant, name, version, family, base_model, rank, layers, size_bytes, skipped, stored, published, created_at"
_USAGE = """
SELECT count(*) AS adapters, coalesce(sum(size_bytes), 0) AS size_bytes FROM tenant_adapters WHERE tenant = %s
"""
_AUDIT = """
INSERT INTO admin_actions (at, actor, action, tenant, key_id, detail)
VALUES (%(now)s, %(actor)s, %(action)s, %(tenant)s, NULL, %(detail)s)
"""


async def _lock_tenant(conn: AsyncConnection[DictRow], tenant: str) -> None:
    """The tenant's uploads, one at a time (its row need not exist: the default tenant has none)."""
    await conn.execute("SELECT pg_advisory_xact_lock(hashtext('tenant_adapters:' || %s))", (tenant,))


class Adapters(Area):
    async def reserve(
        self, new: TenantAdapter, limits: AdapterLimits, *, stale_before: datetime
    ) -> Reserved | AdapterRefusal:
        """``new``'s row, not stored yet, if its tenant's limits let it in; the row
        already there of the same version (the same bytes) otherwise, unless it is an
        upload begun before ``stale_before`` and never stored, which this one takes over."""
        async with self.db.tx() as conn:
            await _lock_tenant(conn, new.tenant)
            key = (new.tenant, new.name, new.version)
            row = await fetch_one(
                conn, f"SELECT {_COLUMNS} FROM tenant_adapters WHERE tenant = %s AND name = %s AND version = %s", key
            )
            if row is not None and (row["stored"] or row["created_at"] >= stale_before):
                return Reserved(TenantAdapter.of(row), fresh=False)
            if row is not None:
                await conn.execute("DELETE FROM tenant_adapters WHERE tenant = %s AND name = %s AND version = %s", key)
            counted = await fetch_one(conn, _USAGE, (new.tenant,))
            assert counted is not None
            refusal = adapter_room(
                new.tenant, new.size_bytes, AdapterUsage(counted["adapters"], int(counted["size_bytes"])), limits
            )
            if refusal is not None:
                return refusal
            made = await fetch_one(
                conn,
                f"""
                INSERT INTO tenant_adapters ({_COLUMNS})
                VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, false, false, %s)
                RETURNING {_COLUMNS}
                """,
                (*key, new.family, new.base_model, new.rank, new.layers, new.size_bytes, ",".join(new.skipped),
                 new.created_at),
            )  # fmt: skip
            assert made is not None
            return Reserved(TenantAdapter.of(made), fresh=True)

    async def stored(self, adapter: TenantAdapter) -> TenantAdapter:
        """The upload done: its jobs may name it."""
        row = await self.db.one(
            f"""
            UPDATE tenant_adapters SET stored = true WHERE tenant = %s AND name = %s AND version = %s
            RETURNING {_COLUMNS}
            """,
            (adapter.tenant, adapter.name, adapter.version),
        )
        if row is None:
            raise NotFound(f"adapter {adapter.reference} of {adapter.tenant!r} was removed while it was uploaded")
        return TenantAdapter.of(row)

    async def discard(self, adapter: TenantAdapter) -> None:
        """An upload that failed: its row goes, unless it was stored meanwhile."""
        await self.db.run(
            "DELETE FROM tenant_adapters WHERE tenant = %s AND name = %s AND version = %s AND NOT stored",
            (adapter.tenant, adapter.name, adapter.version),
        )

    async def abandoned(self, tenant: str, before: datetime) -> list[TenantAdapter]:
        """The tenant's uploads begun before ``before`` and never stored: cut off."""
        rows = await self.db.all(
            f"SELECT {_COLUMNS} FROM tenant_adapters WHERE tenant = %s AND NOT stored AND created_at < %s",
            (tenant, before),
        )
        return [TenantAdapter.of(r) for r in rows]

    async def visible(self, tenant: str, name: str, version: str | None) -> TenantAdapter | None:
        """The stored adapter ``name`` (of ``version``, or its latest) that ``tenant``
        may name: its own first, else a published one."""
        row = await self.db.one(
            f"""
            SELECT {_COLUMNS} FROM tenant_adapters
            WHERE name = %(name)s AND stored AND (tenant = %(tenant)s OR published)
              AND (%(version)s::text IS NULL OR version = %(version)s)
            ORDER BY tenant = %(tenant)s DESC, created_at DESC, version DESC LIMIT 1
            """,
            {"tenant": tenant, "name": name, "version": version},
        )
        return TenantAdapter.of(row) if row is not None else None

    async def listing(self, tenant: str) -> list[TenantAdapter]:
        """What ``tenant`` may name: its own stored adapters, then the others'
        published ones, each by name and newest first."""
        rows = await self.db.all(
            f"""
            SELECT {_COLUMNS} FROM tenant_adapters WHERE stored AND (tenant = %(tenant)s OR published)
            ORDER BY tenant = %(tenant)s DESC, name, created_at DESC, version
            """,
            {"tenant": tenant},
        )
        return [TenantAdapter.of(r) for r in rows]

    async def usage(self, tenant: str) -> AdapterUsage:
        row = await self.db.one(_USAGE, (tenant,))
        return AdapterUsage(row["adapters"], int(row["size_bytes"])) if row is not None else AdapterUsage()

    async def remove(self, tenant: str, name: str, version: str | None) -> list[TenantAdapter]:
        """Removes ``tenant``'s own ``name`` (one version, or all): the versions removed."""
        rows = await self.db.all(
            f"""
            DELETE FROM tenant_adapters
            WHERE tenant = %(tenant)s AND name = %(name)s AND (%(version)s::text IS NULL OR version = %(version)s)
            RETURNING {_COLUMNS}
            """,
            {"tenant": tenant, "name": name, "version": version},
        )
        return sorted((TenantAdapter.of(r) for r in rows), key=lambda a: a.created_at)

    async def of_tenant(self, tenant: str | None) -> list[TenantAdapter]:
        """Every adapter of ``tenant`` (None: of every tenant), uploads under way included."""
        rows = await self.db.all(
            f"""
            SELECT {_COLUMNS} FROM tenant_adapters WHERE %(tenant)s::text IS NULL OR tenant = %(tenant)s
            ORDER BY tenant, name, created_at DESC, version
            """,
            {"tenant": tenant},
        )
        return [TenantAdapter.of(r) for r in rows]

    async def publish(
        self, tenant: str, name: str, version: str | None, published: bool, *, actor: str, now: datetime
    ) -> TenantAdapter:
        """Publishes ``tenant``'s ``name`` (``version``, or its latest stored) to every
        tenant, or takes it back; recorded in ``admin_actions``. A published name is
        one adapter: publishing a second version, or another tenant's of the same
        name, is refused (take the first back)."""
        action = "adapters publish" if published else "adapters unpublish"
        async with self.db.tx() as conn:
            rows = await fetch_all(
                conn,
                f"""
                SELECT {_COLUMNS} FROM tenant_adapters
                WHERE tenant = %(tenant)s AND name = %(name)s AND stored
                  AND (%(version)s::text IS NULL OR version = %(version)s)
                ORDER BY created_at DESC, version DESC LIMIT 1
                FOR UPDATE
                """,
                {"tenant": tenant, "name": name, "version": version},
            )
            if not rows:
                what = f"{name}:{version}" if version else name
                raise NotFound(f"tenant {tenant!r} has no stored adapter {what!r}")
            adapter = TenantAdapter.of(rows[0])
            if published:
                # The unique index is the net for two operators at once; this says why.
                other = await fetch_one(
                    conn,
                    "SELECT tenant, version FROM tenant_adapters WHERE published AND name = %s"
                    " AND (tenant, version) <> (%s, %s)",
                    (name, tenant, adapter.version),
                )
                if other is not None:
                    raise AlreadyExists(
                        f"{name}:{other['version']} of tenant {other['tenant']!r} is published under that name: "
                        "take it back first (`darkroom adapters unpublish`)"
                    )
            row = await fetch_one(
                conn,
                f"""
                UPDATE tenant_adapters SET published = %s WHERE tenant = %s AND name = %s AND version = %s
                RETURNING {_COLUMNS}
                """,
                (published, tenant, name, adapter.version),
            )
            assert row is not None
            params = {"now": now, "actor": actor, "action": action, "tenant": tenant, "detail": adapter.reference}
            await conn.execute(_AUDIT, params)
        return TenantAdapter.of(row)
