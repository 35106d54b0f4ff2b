"""``darkroom models``: push a model's directory (or a builtin) to the model store,
list what it holds, remove a version or a model, list and remove the fleet's
compiled artifacts (``compiled_cli``). The store is the one
DARKROOM_MODEL_STORE_URL (and its credentials) names; push, list and rm sign as its
writer (DARKROOM_MODEL_STORE_WRITER_ACCESS_KEY) where one is set. ``verify`` hashes
this host's cache of it (DARKROOM_MODEL_CACHE_DIR) again."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from services.config.sections import Settings
from services.errors import ModelError
from services.models.host_cache.layout import Layout
from services.models.host_cache.verification import verify
from services.models.store.manifest import check_operators_name, parse_reference
from services.models.store.objects import ObjectStore
from services.models.store.push import PushResult, network_configs, push_directory, source_directory
from services.ops import compiled_cli


def add_commands(sub: Any, run: Any) -> None:
    models = sub.add_parser("models", help="push, list and remove models in the model store")
    actions = models.add_subparsers(dest="models_command", required=True)
    push = actions.add_parser("push", help="upload a diffusers directory or a builtin as NAME[:VERSION]")
    push.add_argument("source", metavar="DIR_OR_BUILTIN", help="a model's directory, or builtin:NAME")
    push.add_argument("reference", metavar="NAME[:VERSION]", help="default version: 12 hex digits of its files' digest")
    push.add_argument(
        "--force", action="store_true", help="replace a version the store holds with other content (hosts follow)"
    )
    push.add_argument(
        "--lora", action="store_true", help="the directory is a LoRA adapter (one .safetensors file), checked first"
    )
    push.add_argument(
        "--base",
        metavar="MODEL",
        help="with --lora: the registry model it adapts (default: the default image model)",
    )
    listing = actions.add_parser("list", help="every version of every model in the store")
    rm = actions.add_parser("rm", help="remove a version (NAME:VERSION) or every version (NAME); unshared blobs go")
    rm.add_argument("reference", metavar="NAME[:VERSION]")
    verify = actions.add_parser(
        "verify", help="hash this host's model cache again; drop what fails (fetched again at the next load)"
    )
    for p in (push, listing, rm, verify):
        p.add_argument("--data-dir", help="where builtins are built (DATA_DIR/models)")
        p.set_defaults(func=run)
    compiled_cli.add_commands(actions, run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    try:
        if args.models_command == "push":
            return _push(args, settings)
        if args.models_command == "list":
            return _list(settings)
        if args.models_command == "verify":
            return _verify(settings)
        if args.models_command == "compiled":
            return compiled_cli.run(args, settings)
        return _rm(args, settings)
    except ModelError as exc:
        print(f"darkroom models: {exc}", file=sys.stderr)
        return 1


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _push(args: argparse.Namespace, settings: Settings) -> int:
    check_operators_name(parse_reference(args.reference)[0])  # refused before anything is built or read
    if args.base and not args.lora:
        raise ModelError("--base names the model an adapter adapts: it comes with --lora")
    store = ObjectStore.from_settings(settings.kernel.model_store.as_writer())
    if args.lora:
        return _push_adapter(args, settings, store)
    root = source_directory(args.source, settings.kernel.models_dir)
    result = push_directory(store, root, args.reference, entry=network_configs(root), force=args.force)
    _report(result, root)
    return 0


def _push_adapter(args: argparse.Namespace, settings: Settings, store: ObjectStore) -> int:
    from services.models.adapters.pushing import push_adapter

    registry = settings.kernel.registry()
    base = registry.get(args.base) if args.base else registry.default_for("image")
    if base is None:
        raise ModelError("--lora: no default image model in the registry; name the adapter's with --base MODEL")
    root = Path(args.source).expanduser()
    if not root.is_dir():
        raise ModelError(f"{args.source}: no such directory")
    result, weights = push_adapter(store, root, args.reference, base, settings.kernel.models_dir, force=args.force)
    print(
        f"adapter for {base.name} ({base.family}): rank {weights.rank}, {len(weights.layers)} layers of its network"
        + (f"; not applied: its {', '.join(weights.skipped)} part" if weights.skipped else "")
    )
    _report(result, root)
    return 0


def _report(result: PushResult, root: Path) -> None:
    m = result.manifest
    if result.replaced is not None:
        print(f"replaced {m.name}:{m.version} (manifest sha256 {result.replaced.digest[:12]}, now {m.digest[:12]})")
    print(f"pushed {m.name}:{m.version} from {root}: {len(m.files)} files, {_mb(m.total_bytes)}")
    print(f"uploaded {len(result.uploaded)} blobs ({_mb(result.uploaded_bytes)}); ", end="")
    print(f"{len(result.present)} already in the store ({_mb(result.present_bytes)})")
    print(m.version)  # last: what a script reads


def _list(settings: Settings) -> int:
    store = ObjectStore.from_settings(settings.kernel.model_store.as_writer())
    listed = store.list_models()
    if not listed:
        print(f"no models in {store.url} (bucket {store.bucket})")
        return 0
    print(f"{'NAME':<24} {'VERSION':<16} {'KIND':<6} {'FILES':>5} {'SIZE':>12}  LATEST")
    for v in listed:
        size = _mb(v.total_bytes)
        print(f"{v.name:<24} {v.version:<16} {v.kind:<6} {v.files:>5} {size:>12}  {'*' if v.latest else ''}")
    return 0


def _rm(args: argparse.Namespace, settings: Settings) -> int:
    name, version = parse_reference(args.reference)
    store = ObjectStore.from_settings(settings.kernel.model_store.as_writer())
    removal = store.remove(name, version)
    print(f"removed {', '.join(f'{name}:{v}' for v in removal.versions)}")
    print(
        f"deleted {removal.blobs_deleted} blobs ({_mb(removal.bytes_deleted)}); "
        f"kept {removal.blobs_kept} that other versions use"
    )
    return 0


def _verify(settings: Settings) -> int:
    """Exit 1 when something was corrupt (and dropped), as fsck says it corrected errors."""
    layout = Layout(settings.kernel.model_cache_dir)
    if not (layout.root / "blobs" / "sha256").is_dir():
        print(f"no model cache at {layout.root}")
        return 0
    found = asyncio.run(verify(layout))
    print(f"checked {found.checked} blobs ({_mb(found.checked_bytes)}) in {layout.root}")
    for digest in found.corrupt:
        print(f"corrupt: blob {digest}, deleted")
    for version in found.dropped:
        print(f"dropped {version}: it linked a corrupt blob; fetched again at its next load")
    return 1 if found.corrupt else 0
