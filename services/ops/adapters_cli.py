"""``darkroom adapters``: tenants' own LoRA adapters, as an operator sees them, in
the database of ``--data-dir`` or of ``DARKROOM_DATABASE_URL`` (as ``darkroom
tenants``): every tenant's listed, and one published to every tenant or taken back.
Tenants upload, list and remove their own through the API (UploadAdapter,
``POST /v1/adapters``); the operator's own adapters are pushed to the model store
(``darkroom models push --lora``) and are every tenant's."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from datetime import UTC, datetime

from services.config.sections import Settings
from services.db.adapter_records import TenantAdapter
from services.db.repository import Repository
from services.errors import FieldViolation, InvalidArgument, ModelError
from services.models.store.manifest import parse_reference
from services.ops.tenants_actions import actor


def add_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], run: Callable[[argparse.Namespace], int]
) -> None:
    adapters = sub.add_parser(
        "adapters", help="list tenants' own adapters; publish one to every tenant"
    ).add_subparsers(dest="adapters_command", required=True)
    listing = adapters.add_parser("list", help="every tenant's adapters (or one tenant's), uploads under way too")
    listing.add_argument("tenant", nargs="?")
    listing.set_defaults(func=run, act=list_adapters)
    publish = adapters.add_parser("publish", help="let every tenant name one (its latest version, or the one given)")
    unpublish = adapters.add_parser("unpublish", help="take a published one back: its own tenant's alone again")
    for parser, act in ((publish, publish_adapter), (unpublish, unpublish_adapter)):
        parser.add_argument("tenant")
        parser.add_argument("reference", metavar="NAME[:VERSION]")
        parser.set_defaults(func=run, act=act)
    for parser in (listing, publish, unpublish):
        parser.add_argument("--data-dir", help="act on the database `darkroom up --data-dir DIR` runs")


async def list_adapters(args: argparse.Namespace, settings: Settings, repo: Repository) -> int:
    found = await repo.adapters.of_tenant(args.tenant)
    if not found:
        print("darkroom: no tenant's adapters" + (f" of {args.tenant!r}" if args.tenant else ""))
    for adapter in found:
        _print(adapter)
    return 0


async def publish_adapter(args: argparse.Namespace, settings: Settings, repo: Repository) -> int:
    return await _publish(args, repo, published=True)


async def unpublish_adapter(args: argparse.Namespace, settings: Settings, repo: Repository) -> int:
    return await _publish(args, repo, published=False)


async def _publish(args: argparse.Namespace, repo: Repository, *, published: bool) -> int:
    try:
        name, version = parse_reference(args.reference)
    except ModelError as exc:
        raise InvalidArgument([FieldViolation("NAME[:VERSION]", str(exc))]) from None
    adapter = await repo.adapters.publish(args.tenant, name, version, published, actor=actor(), now=datetime.now(UTC))
    _print(adapter)
    return 0


def _print(a: TenantAdapter) -> None:
    state = "published" if a.published else ("private" if a.stored else "uploading")
    print(
        f"{a.tenant} {a.reference}: {a.family} (checked against {a.base_model}), rank {a.rank}, {a.layers} layers, "
        f"{a.size_bytes / 2**20:.1f} MiB, {state}, {a.created_at.isoformat(timespec='seconds')}"
    )
