"""``darkroom tenants`` and ``darkroom keys``: tenants, their terms and their API
keys, in the database of ``--data-dir`` (the one ``darkroom up`` runs there, started
for the command if it is not running) or of ``DARKROOM_DATABASE_URL``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import re
import sys
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from services import quotas
from services.config.safety import OUTPUT_POLICIES
from services.config.sections import KernelSettings, Settings
from services.db.repository import Repository
from services.db.tenant_records import KeyRecord, TenantRecord, TenantTerms
from services.errors import RequestError

_UNLIMITED = ("none", "unlimited")
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def add_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], run: Callable[[argparse.Namespace], int]
) -> None:
    """The ``tenants`` and ``keys`` commands; ``run`` runs the one parsed (``run`` below,
    with the command line's settings)."""
    tenants = sub.add_parser("tenants", help="create, list, show and change tenants").add_subparsers(
        dest="tenants_command", required=True
    )
    create = tenants.add_parser("create", help="a new tenant")
    create.add_argument("name")
    create.add_argument("--lane", required=True, help="the lane its jobs run in (DARKROOM_LANES)")
    _term_options(create, defaults=True)
    create.set_defaults(func=run, act=_create_tenant)
    update = tenants.add_parser("update", help="change a tenant's terms (the options given)")
    update.add_argument("name")
    update.add_argument("--lane", help="the lane its jobs run in (DARKROOM_LANES)")
    _term_options(update, defaults=False)
    update.add_argument(
        "--add-credits",
        type=_finite,
        metavar="N",
        help="add N credits to its balance (negative: take them away); not with --credits",
    )
    update.set_defaults(func=run, act=_update_tenant)
    listing = tenants.add_parser("list", help="every tenant")
    listing.set_defaults(func=run, act=_list_tenants)
    show = tenants.add_parser("show", help="one tenant and its keys")
    show.add_argument("name")
    show.set_defaults(func=run, act=_show_tenant)

    keys = sub.add_parser("keys", help="create, list and revoke API keys").add_subparsers(
        dest="keys_command", required=True
    )
    new = keys.add_parser("create", help="a new key for a tenant, printed once on the last line")
    new.add_argument("tenant")
    new.add_argument("--admin", action="store_true", help="may read the whole fleet's detail (GetStats)")
    new.set_defaults(func=run, act=_create_key)
    listed = keys.add_parser("list", help="a tenant's keys (never the keys themselves)")
    listed.add_argument("tenant")
    listed.set_defaults(func=run, act=_list_keys)
    revoke = keys.add_parser("revoke", help="revoke a key: every gateway refuses it within a second")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=run, act=_revoke_key)
    for parser in (create, update, listing, show, new, listed, revoke):
        parser.add_argument("--data-dir", help="act on the database `darkroom up --data-dir DIR` runs")


def _term_options(p: argparse.ArgumentParser, *, defaults: bool) -> None:
    unset = None if defaults else argparse.SUPPRESS
    limit = "; 'none' for no limit" if not defaults else " (default: no limit)"
    balance = "its credit balance (GPU-seconds times price); its open jobs' reservations stay held against it"
    daily = "once a UTC day, the balance raised by up to this, to at most this (a debt is paid first)"
    p.add_argument("--credits", type=_at_least(0.0), default=unset, help=f"{balance}{limit}")
    p.add_argument("--daily-credits", type=_at_least(0.0), default=unset, help=f"{daily}{limit}")
    p.add_argument("--max-jobs", type=_at_least(1, int), default=unset, help=f"jobs queued or running at once{limit}")
    p.add_argument(
        "--rate", type=_at_least(0.001), default=unset, help=f"calls per second: submits and moderations{limit}"
    )
    p.add_argument(
        "--weight",
        type=_at_least(0.001, unlimited=False),
        default=1.0 if defaults else argparse.SUPPRESS,
        help="its share of its lane against other tenants (default 1)",
    )
    p.add_argument(
        "--expand-prompts",
        action=argparse.BooleanOptionalAction,
        default=False if defaults else argparse.SUPPRESS,
        help="expand its jobs' prompts unless a request says otherwise (default: no)",
    )
    lane = "its lane's (DARKROOM_OUTPUT_POLICIES)"
    p.add_argument(
        "--output-policy",
        type=_output_policy,
        default=unset,
        help="what the image filter's flag does to its jobs' outputs: block (withheld), blur, or flag (returned as "
        f"made, marked); default: {lane}" + ("" if defaults else f"; 'lane' for {lane}"),
    )


def _at_least(low: float, kind: Callable[[str], Any] = float, *, unlimited: bool = True) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if unlimited and text.lower() in _UNLIMITED:
            return None
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (isinstance(value, int) or math.isfinite(value)) or value < low:
            raise argparse.ArgumentTypeError(f"{text} is below {low}" if value < low else f"{text} is not finite")
        return value

    return parse


def _output_policy(text: str) -> str | None:
    if text.lower() == "lane":
        return None
    if text not in OUTPUT_POLICIES:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(OUTPUT_POLICIES)} (or 'lane')")
    return text


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not finite")
    return value


# -- the commands ------------------------------------------------------------------


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Runs the command ``args`` name against its database."""
    try:
        with _database(args, settings.kernel) as url:
            return asyncio.run(_with_repository(url, lambda repo: args.act(args, settings, repo)))
    except (RequestError, ValueError) as exc:
        print(f"darkroom: {exc}", file=sys.stderr)
        return 2


async def _with_repository(url: str, act: Callable[[Repository], Awaitable[int]]) -> int:
    from services.db.migrate import upgrade

    await asyncio.to_thread(upgrade, url)
    repo = Repository(url, pool_size=1, application_name="darkroom-cli")
    try:
        return await act(repo)
    finally:
        await repo.close()


@contextlib.contextmanager
def _database(args: argparse.Namespace, kernel: KernelSettings) -> Iterator[str]:
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


async def _create_tenant(args: argparse.Namespace, settings: Settings, repo: Repository) -> int:
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
    )
    tenant = await repo.tenants.create(args.name, terms, actor=_actor(), now=datetime.now(UTC))
    _print_tenant(tenant, await repo.credits.held([tenant.name]))
    return 0


async def _update_tenant(args: argparse.Namespace, settings: Settings, repo: Repository) -> int:
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
        )
        if hasattr(args, option) and not (option == "lane" and args.lane is None)
    }
    if "lane" in given:
        _check_lane(given["lane"], settings)
    add = args.add_credits
    if add is not None and "credits" in given:
        raise ValueError("--credits sets the balance and --add-credits adds to it: give one of them")
    tenant = await repo.tenants.update(args.name, given, add_credits=add, actor=_actor(), now=datetime.now(UTC))
    _print_tenant(tenant, await repo.credits.held([tenant.name]))
    return 0


async def _list_tenants(args: argparse.Namespace, settings: Settings, repo: Repository) -> int:
    tenants = await repo.tenants.all()
    if not tenants:
        print("darkroom: no tenants: the API is open to anyone who can reach it")
    held = await repo.credits.held([tenant.name for tenant in tenants])
    for tenant in tenants:
        _print_tenant(tenant, held)
    return 0


async def _show_tenant(args: argparse.Namespace, settings: Settings, repo: Repository) -> int:
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


async def _create_key(args: argparse.Namespace, settings: Settings, repo: Repository) -> int:
    from services.api_keys import new_key

    issued = new_key()
    key = await repo.tenants.add_key(args.tenant, issued, admin=args.admin, actor=_actor(), now=datetime.now(UTC))
    _print_key(key)
    print("darkroom: the key follows; it is shown this once and stored only as a digest")
    print(issued.key, flush=True)
    return 0


async def _list_keys(args: argparse.Namespace, settings: Settings, repo: Repository) -> int:
    for key in await repo.tenants.keys(args.tenant):
        _print_key(key)
    return 0


async def _revoke_key(args: argparse.Namespace, settings: Settings, repo: Repository) -> int:
    _print_key(await repo.tenants.revoke(args.key_id, actor=_actor(), now=datetime.now(UTC)))
    return 0


def _actor() -> str:
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
    )


def _print_key(key: KeyRecord) -> None:
    state = f"revoked {key.revoked_at.isoformat(timespec='seconds')}" if key.revoked_at else "active"
    role = "admin" if key.admin else "tenant"
    print(f"key {key.id}: tenant {key.tenant}, {role}, created {key.created_at.isoformat(timespec='seconds')}, {state}")
