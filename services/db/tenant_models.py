"""The tenants' tables: who may submit and on what terms (``tenants``), their keys
(``api_keys``), what they spent by day (``tenant_usage``) and for fair sharing
(``tenant_shares``), their credit ledgers (``credit_entries``), the admin
actions taken on them (``admin_actions``), and their own LoRA adapters
(``tenant_adapters``).
Part of the one schema ``models.py`` describes, on its ``Base``."""

from __future__ import annotations

from datetime import date, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    String,
    Text,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

from services.db.base import Base


class TenantRow(Base):
    """Who may submit, in which lane, and how much."""

    __tablename__ = "tenants"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    # Its jobs run in this lane; a request may ask for a lower one, never a higher.
    lane: Mapped[str] = mapped_column(String(32), nullable=False)
    # Its credit balance, in GPU-seconds times the model's price: the sum of its
    # credit_entries. Its open jobs' reservations are held apart from it (what it
    # may still reserve is this less their credits_reserved). NULL: no limit.
    credits: Mapped[float | None] = mapped_column(Float)
    # Credits given back each day; NULL: none.
    daily_credits: Mapped[float | None] = mapped_column(Float)
    # At most this many of its jobs queued or running at once; NULL: no limit.
    max_jobs: Mapped[int | None] = mapped_column(Integer)
    # Submits per second, shared by every gateway; NULL: no limit.
    rate_per_s: Mapped[float | None] = mapped_column(Float)
    # Its share of its lane's GPUs against the other tenants there.
    weight: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("1"))
    # Its rate's token bucket: the submits it held at rate_at (NULL: never drawn on, full).
    rate_tokens: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("0"))
    rate_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The UTC day its daily credits were last given (NULL: never).
    credits_day: Mapped[date | None] = mapped_column(Date)
    # What the image filter's flag does to its jobs' outputs: "block", "blur" or
    # "flag"; NULL: its lane's default.
    output_policy: Mapped[str | None] = mapped_column(String(8))
    # Its prompts are expanded unless a request says otherwise.
    expand_prompts: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    # Its own adapters: at most this many versions stored, of at most this many MB
    # in all; NULL: the gateway's defaults (DARKROOM_TENANT_ADAPTERS_MAX, _MB).
    max_adapters: Mapped[int | None] = mapped_column(Integer)
    max_adapter_mb: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)


class TenantAdapterRow(Base):
    """A tenant's own LoRA adapter version, its bytes in the model store under
    tenants/tenant.TENANT/ (``services.models.store.manifest.tenant_prefix``). Not a
    foreign key, as ``tenant_usage``: the default tenant needs no row."""

    __tablename__ = "tenant_adapters"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(48), primary_key=True)
    version: Mapped[str] = mapped_column(String(64), primary_key=True)  # made from its bytes
    family: Mapped[str] = mapped_column(String(32), nullable=False)
    base_model: Mapped[str] = mapped_column(String(128), nullable=False)  # the model it was checked against
    rank: Mapped[int] = mapped_column(Integer, nullable=False)
    layers: Mapped[int] = mapped_column(Integer, nullable=False)
    size_bytes: Mapped[int] = mapped_column(BigInteger, nullable=False)
    # The parts of its file not applied (a text encoder's), comma-separated.
    skipped: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("''"))
    # False while its upload is under way (it counts against the tenant's limits,
    # and no job may name it); a row still false long after was an upload cut off.
    stored: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    # Every tenant may name it (an operator's `darkroom adapters publish`).
    published: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)

    # Published names are one namespace: a request naming one finds one.
    __table_args__ = (
        Index("ix_tenant_adapters_published_name", "name", unique=True, postgresql_where=text("published")),
    )


class TenantUsageRow(Base):
    """What a tenant's jobs cost on a UTC day, as they were settled. Not a foreign
    key: the default tenant needs no row."""

    __tablename__ = "tenant_usage"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    day: Mapped[date] = mapped_column(Date, primary_key=True)
    jobs: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    gpu_seconds: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("0"))
    credits: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("0"))


class TenantShareRow(Base):
    """A tenant's GPU-seconds for fair sharing, decayed as of ``used_at``: the
    scheduler's settlement adds to it (``scheduler.fair_share`` decays it)."""

    __tablename__ = "tenant_shares"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    used_s: Mapped[float] = mapped_column(Float, nullable=False, server_default=text("0"))
    used_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)


class CreditEntryRow(Base):
    """One movement of a tenant's credit balance: the balance is the sum of its
    entries. Written in the transaction that moves the balance. Not a foreign key,
    as ``tenant_usage``."""

    __tablename__ = "credit_entries"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), nullable=False)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    # "initial" (made with credits), "adjust" (an operator's --credits or
    # --add-credits), "top_up" (daily credits), "charge" (a settled job's cost).
    kind: Mapped[str] = mapped_column(String(16), nullable=False)
    amount: Mapped[float] = mapped_column(Float, nullable=False)  # signed: a charge is negative
    job_id: Mapped[str | None] = mapped_column(String(36))  # the charged job

    __table_args__ = (Index("ix_credit_entries_tenant_at", "tenant", "at"),)


class ApiKeyRow(Base):
    """A tenant's key, stored only as a digest: the key itself is shown once."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), ForeignKey("tenants.name", ondelete="CASCADE"), nullable=False)
    digest: Mapped[str] = mapped_column(String(64), nullable=False)  # SHA-256 of the whole key, hex
    # May read the whole fleet's detail (GetStats).
    admin: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=text("false"))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index("ix_api_keys_tenant", "tenant"),)


class AdminActionRow(Base):
    """An admin action (a tenant created or changed, a key made or revoked): who, when."""

    __tablename__ = "admin_actions"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    # Who did it: the operating-system user and host the `darkroom` command ran as.
    actor: Mapped[str] = mapped_column(String(200), nullable=False)
    action: Mapped[str] = mapped_column(String(32), nullable=False)  # e.g. "keys revoke"
    tenant: Mapped[str] = mapped_column(String(64), nullable=False)
    key_id: Mapped[str | None] = mapped_column(String(32))
    # The terms set, or the key's role; never a key.
    detail: Mapped[str] = mapped_column(Text, nullable=False, server_default=text("''"))

    __table_args__ = (Index("ix_admin_actions_tenant_at", "tenant", "at"),)
