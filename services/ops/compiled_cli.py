"""``darkroom models compiled``: the fleet's compiled artifacts in the model store
(``services.models.compile_cache``), listed with what their signed records say, and
removed as the store's writer. A removed artifact's record is gone: every host that
loaded it deletes what it took from it at its next compile."""

from __future__ import annotations

import argparse
import re
from typing import Any

from services.config.sections import Settings
from services.errors import ModelError
from services.models.compile_record import RECORD_SUFFIX, UntrustedArtifact, unverified_record, verified_record
from services.models.store.objects import ObjectStore

_DIGEST = re.compile(r"[0-9a-f]{64}")


def add_commands(actions: Any, run: Any) -> None:
    compiled = actions.add_parser("compiled", help="list or remove the fleet's compiled artifacts")
    commands = compiled.add_subparsers(dest="compiled_command", required=True)
    commands.add_parser("list", help="each compile key's artifact: size, when, by which sampler, whether it verifies")
    rm = commands.add_parser("rm", help="remove a compile key's artifact and its record (every host drops its files)")
    which = rm.add_mutually_exclusive_group(required=True)
    which.add_argument("digest", nargs="?", metavar="DIGEST", help="the compile key's digest, as `list` shows it")
    which.add_argument("--all", action="store_true", help="every compiled artifact in the store")
    for p in commands.choices.values():
        p.set_defaults(func=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    store = ObjectStore.from_settings(settings.kernel.model_store.as_writer())
    if args.compiled_command == "list":
        return _list(store, settings)
    return _rm(store, args)


def _digests(names: dict[str, int]) -> list[str]:
    return sorted({name.removesuffix(RECORD_SUFFIX) for name in names})


def _list(store: ObjectStore, settings: Settings) -> int:
    names = store.compiled_names()
    if not names:
        print(f"no compiled artifacts in {store.url} (bucket {store.bucket})")
        return 0
    signing = settings.sampler.compile_signing_key
    print(f"{'DIGEST':<64} {'SIZE':>10}  {'PUBLISHED':<25} {'WORKER':<24} CHECK")
    for digest in _digests(names):
        size = f"{names[digest] / 1e6:.1f} MB" if digest in names else "-"
        record = store.read_compiled(digest + RECORD_SUFFIX)
        if record is None:
            print(f"{digest} {size:>10}  {'-':<25} {'-':<24} no record: never loaded")
            continue
        try:
            claimed = unverified_record(record)
        except UntrustedArtifact as exc:
            print(f"{digest} {size:>10}  {'-':<25} {'-':<24} {exc}")
            continue
        check = f"signed by {claimed.signer}, unchecked (no DARKROOM_COMPILE_SIGNING_KEY_FILE)"
        if signing is not None:
            try:
                verified_record(record, signing.key.public_key(), digest)
                check = f"signed by {claimed.signer}: verifies"
            except UntrustedArtifact as exc:
                check = f"untrusted: {exc}"
        print(f"{digest} {size:>10}  {claimed.published_at:<25} {claimed.worker:<24} {check}")
    return 0


def _rm(store: ObjectStore, args: argparse.Namespace) -> int:
    names = store.compiled_names()
    if args.all:
        doomed = _digests(names)
    else:
        if not _DIGEST.fullmatch(args.digest):
            raise ModelError(
                f"{args.digest!r}: a compile key's digest is 64 hex digits (`darkroom models compiled list`)"
            )
        if args.digest not in names and args.digest + RECORD_SUFFIX not in names:
            raise ModelError(f"no compiled artifacts under {args.digest} in {store.url} (bucket {store.bucket})")
        doomed = [args.digest]
    if doomed:
        # The records first: an artifact without one is never loaded.
        store.remove_compiled([d + RECORD_SUFFIX for d in doomed if d + RECORD_SUFFIX in names])
        store.remove_compiled([d for d in doomed if d in names])
    for digest in doomed:
        print(f"removed {digest}")
    print(f"removed {len(doomed)} compiled artifacts; each host that loaded one drops its files at its next compile")
    return 0
