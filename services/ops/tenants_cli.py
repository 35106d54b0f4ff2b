"""``darkroom tenants`` and ``darkroom keys``: tenants, their terms and their API
keys, in the database of ``--data-dir`` (the one ``darkroom up`` runs there, started
for the command if it is not running) or of ``DARKROOM_DATABASE_URL``. Here: the
commands and their options, and running the one parsed; what each does to the
database is in ``tenants_actions``."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from collections.abc import Callable
from typing import Any

from services.config.safety import OUTPUT_POLICIES
from services.config.sections import Settings
from services.errors import RequestError
from services.ops import tenants_actions

_UNLIMITED = ("none", "unlimited")


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
    create.set_defaults(func=run, act=tenants_actions.create_tenant)
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
    update.set_defaults(func=run, act=tenants_actions.update_tenant)
    listing = tenants.add_parser("list", help="every tenant")
    listing.set_defaults(func=run, act=tenants_actions.list_tenants)
    show = tenants.add_parser("show", help="one tenant and its keys")
    show.add_argument("name")
    show.set_defaults(func=run, act=tenants_actions.show_tenant)

    keys = sub.add_parser("keys", help="create, list and revoke API keys").add_subparsers(
        dest="keys_command", required=True
    )
    new = keys.add_parser("create", help="a new key for a tenant, printed once on the last line")
    new.add_argument("tenant")
    new.add_argument("--admin", action="store_true", help="may read the whole fleet's detail (GetStats)")
    new.set_defaults(func=run, act=tenants_actions.create_key)
    listed = keys.add_parser("list", help="a tenant's keys (never the keys themselves)")
    listed.add_argument("tenant")
    listed.set_defaults(func=run, act=tenants_actions.list_keys)
    revoke = keys.add_parser("revoke", help="revoke a key: every gateway refuses it within a second")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=run, act=tenants_actions.revoke_key)
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
    default = "; 'none' for the gateway's default" if not defaults else ""
    p.add_argument(
        "--max-adapters",
        type=_at_least(0, int),
        default=unset,
        help=f"adapter versions of its own it may keep (default: DARKROOM_TENANT_ADAPTERS_MAX){default}",
    )
    p.add_argument(
        "--adapter-mb",
        type=_at_least(0.0),
        default=unset,
        help=f"MiB of adapters of its own it may keep in all (default: DARKROOM_TENANT_ADAPTER_MB){default}",
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


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Runs the command ``args`` name against its database."""
    try:
        with tenants_actions.database(args, settings.kernel) as url:
            return asyncio.run(tenants_actions.with_repository(url, lambda repo: args.act(args, settings, repo)))
    except (RequestError, ValueError) as exc:
        print(f"darkroom: {exc}", file=sys.stderr)
        return 2
