"""What ``darkroom tenants`` and ``darkroom keys`` do (``tenants_cli`` parses them):
tenants, their terms and their API keys, in the database of ``--data-dir`` (the one
``darkroom up`` runs there, started for the command if it is not running) or of
``DARKROOM_DATABASE_URL``, and how they are printed."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from services import quotas
from services.config.sections import KernelSettings, Settings
from services.db.repository import Repository
from services.db.tenant_records import KeyRecord, TenantRecord, TenantTerms

_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


async def with_repository(url: str, act: Callable[[Repository], Awaitable[int]]) -> int:
    """``act`` on a repository of ``url``, its migrations applied first."""
    from services.db.migrate import upgrade

    await asyncio.to_thread(upgrade, url)
    repo = Repository(url, pool_size=1, application_name="darkroom-cli")
    try:
        return await act(repo)
    finally:
        await repo.close()


@contextlib.contextmanager
def database(args: argparse.Namespace, kernel: KernelSettings) -> Iterator[str]:
    """The database to act on: DARKROOM_DATABASE_URL's, unless --data-dir names one;
    else the embedded one of the data directory, started for the command if no
    ``darkroom up`` is running it."""
    from services.ops.embedded import EmbeddedPostgres

    if kernel.database_url and not args.data_dir:
        yield kernel.database_url
        return
    mesh_dir = Path(kernel.mesh_dir) if kernel.mesh_dir else None  # where `darkroom up` keeps the password
    pg = EmbeddedPostgres(kernel.data_dir, mesh_dir=mesh_dir)
    port = pg.running_port()
    if port is not None:
        yield EmbeddedPostgres(kernel.data_dir, port, mesh_dir=mesh_dir).url
        return
    pg.start()
    try:
        yield pg.url
    finally:
        pg.stop()


def _check_lane(lane: str, settings: Settings) -> None:
    known = [lane.name for lane in settings.gateway.placement.lanes]
    if lane not in known:
        raise ValueError(f"--lane: unknown lane {lane!r}; known (DARKROOM_LANES): {', '.join(known)}")


async def create_tenant(args: argparse.Namespace, settings: Settings, repo: Repository) -> int:
    if not _NAME.fullmatch(args.name):
        raise ValueError(f"tenant name {args.name!r}: use 1 to 64 letters, digits, '.', '_' or '-'")
    _check_lane(args.lane, settings)
    terms = TenantTerms(
        args.lane,
        args.credits,
        args.daily_credits,
        args.max_jobs,
        args.rate,
        args.weight,
        expand_prompts=args.expand_prompts,
        output_policy=args.output_policy,
        max_adapters=args.max_adapters,
        max_adapter_mb=args.adapter_mb,
    )
    tenant = await repo.tenants.create(args.name, terms, actor=actor(), now=datetime.now(UTC))
    _print_tenant(tenant, await repo.credits.held([tenant.name]))
    return 0


async def update_tenant(args: argparse.Namespace, settings: Settings, repo: Repository) -> int:
    given = {
        field: getattr(args, option)
        for option, field in (
            ("lane", "lane"),
            ("credits", "credits"),
            ("daily_credits", "daily_credits"),
            ("max_jobs", "max_jobs"),
            ("rate", "rate_per_s"),
            ("weight", "weight"),
            ("expand_prompts", "expand_prompts"),
            ("output_policy", "output_policy"),
            ("max_adapters", "max_adapters"),
            ("adapter_mb", "max_adapter_mb"),
        )
        if hasattr(args, option) and not (option == "lane" and args.lane is None)
    }
    if "lane" in given:
        _check_lane(given["lane"], settings)
    add = args.add_credits
    if add is not None and "credits" in given:
        raise ValueError("--credits sets the balance and --add-credits adds to it: give one of them")
    tenant = await repo.tenants.update(args.name, given, add_credits=add, actor=actor(), now=datetime.now(UTC))
    _print_tenant(tenant, await repo.credits.held([tenant.name]))
    return 0


async def list_tenants(args: argparse.Namespace, settings: Settings, repo: Repository) -> int:
    tenants = await repo.tenants.all()
    if not tenants:
        print("darkroom: no tenants: the API is open to anyone who can reach it")
    held = await repo.credits.held([tenant.name for tenant in tenants])
    for tenant in tenants:
        _print_tenant(tenant, held)
    return 0


async def show_tenant(args: argparse.Namespace, settings: Settings, repo: Repository) -> int:
    tenant = await repo.tenants.get(args.name)
    _print_tenant(tenant, await repo.credits.held([tenant.name]))
    for key in await repo.tenants.keys(args.name):
        _print_key(key)
    for entry in await repo.credits.entries(args.name):
        job = f" job {entry.job_id}" if entry.job_id else ""
        print(f"credits {entry.at.isoformat(timespec='seconds')} {entry.kind} {entry.amount:+g}{job}")
    for action in await repo.tenants.actions(args.name):
        which = f" key {action.key_id}" if action.key_id else ""
        detail = f": {action.detail}" if action.detail else ""
        print(f"{action.at.isoformat(timespec='seconds')} {action.actor}: {action.action}{which}{detail}")
    return 0


async def create_key(args: argparse.Namespace, settings: Settings, repo: Repository) -> int:
    from services.api_keys import new_key

    issued = new_key()
    key = await repo.tenants.add_key(args.tenant, issued, admin=args.admin, actor=actor(), now=datetime.now(UTC))
    _print_key(key)
    print("darkroom: the key follows; it is shown this once and stored only as a digest")
    print(issued.key, flush=True)
    return 0


async def list_keys(args: argparse.Namespace, settings: Settings, repo: Repository) -> int:
    for key in await repo.tenants.keys(args.tenant):
        _print_key(key)
    return 0


async def revoke_key(args: argparse.Namespace, settings: Settings, repo: Repository) -> int:
    _print_key(await repo.tenants.revoke(args.key_id, actor=actor(), now=datetime.now(UTC)))
    return 0


def actor() -> str:
    """Who runs this command, for the record of admin actions: user and host."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def _print_tenant(tenant: TenantRecord, held: dict[str, float]) -> None:
    """``held``: what each tenant's open jobs hold of its credits."""
    t = tenant.terms
    # The balance as the next submit sees it, today's daily credits given; what
    # it may still reserve is that less what its open jobs hold.
    balance, _ = quotas.refilled(t.credits, t.daily_credits, tenant.credits_day, datetime.now(UTC).date())
    hold = held.get(tenant.name, 0.0)

    def limit(value: float | None) -> str:
        return "none" if value is None else f"{value:g}"

    credits = limit(balance)
    if balance is not None:
        credits += f" ({hold:g} held by open jobs, {balance - hold:g} available)"
    print(
        f"tenant {tenant.name}: lane {t.lane}, credits {credits}, daily credits {limit(t.daily_credits)}, "
        f"max jobs {limit(t.max_jobs)}, rate {limit(t.rate_per_s)}{'/s' if t.rate_per_s else ''}, weight {t.weight:g}"
        f"{', prompts expanded' if t.expand_prompts else ''}"
        f", output policy {t.output_policy or 'of its lane'}"
        f", adapters {_or_default(t.max_adapters)} versions of {_or_default(t.max_adapter_mb)} MiB"
    )


def _or_default(value: float | None) -> str:
    return "the gateway's default" if value is None else f"{value:g}"


def _print_key(key: KeyRecord) -> None:
    state = f"revoked {key.revoked_at.isoformat(timespec='seconds')}" if key.revoked_at else "active"
    role = "admin" if key.admin else "tenant"
    print(f"key {key.id}: tenant {key.tenant}, {role}, created {key.created_at.isoformat(timespec='seconds')}, {state}")
