"""The ``darkroom`` command."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from services.config.fields import SettingsError
from services.config.sections import KernelSettings, Settings
from services.ops import SERVICE_MODULES, generate_cli

if TYPE_CHECKING:
    from services.telemetry.metrics import Target


def _settings(args: argparse.Namespace) -> Settings:
    """Every setting, from the environment and the command line's options."""
    changed = {}
    if getattr(args, "data_dir", None):
        changed["DARKROOM_DATA_DIR"] = str(Path(args.data_dir).expanduser().resolve())
    if getattr(args, "port", None) is not None:
        changed["DARKROOM_GATEWAY_PORT"] = str(args.port)
    if getattr(args, "http_port", None) is not None:
        changed["DARKROOM_HTTP_PORT"] = str(args.http_port)
    return Settings.from_env({**os.environ, **changed})


def cmd_up(args: argparse.Namespace) -> int:
    from services.ops.data_lock import DataDirLocked
    from services.ops.stack import LocalStack

    stack = LocalStack(
        _settings(args),
        cpu_workers=args.cpu_workers,
        decoders=args.decoders,
        http=True,
        model_store=getattr(args, "model_store", False),
    )
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    try:
        try:
            stack.start()
        except DataDirLocked as exc:
            print(f"darkroom: {exc}", file=sys.stderr)
            return 1
        data_dir = stack.settings.kernel.data_dir
        print(f"darkroom: gateway listening on {stack.gateway_address} (data in {data_dir})", flush=True)
        print(f"darkroom: OpenAI-compatible HTTP API on {stack.http_url}/v1", flush=True)
        if stack.model_store is not None:
            from services.ops.store_identities import WRITER_SECRET_FILE

            store, secrets = stack.model_store, Path(stack.settings.kernel.mesh_dir)
            print(f"darkroom: model store (S3) on {store.url}, bucket {store.bucket}", flush=True)
            print(
                f"darkroom:   `darkroom models` writes it as {store.writer.access_key} "
                f"(DARKROOM_MODEL_STORE_WRITER_ACCESS_KEY), its secret in {secrets / WRITER_SECRET_FILE}",
                flush=True,
            )
        _print_metrics(stack.metrics_targets(), data_dir)
        if args.demo_prompt is not None:
            return generate_cli.generate_into(stack.gateway_address, args.demo_prompt, args, stack.gateway_roots())
        stopped.wait()
        print("darkroom: stopping", flush=True)
        return 0
    finally:
        stack.stop()


def _print_metrics(targets: list[Target], data_dir: Path) -> None:
    from services.telemetry.metrics import targets_path

    print(f"darkroom: metrics, listed for Prometheus in {targets_path(data_dir)}:", flush=True)
    for t in targets:
        print(f"darkroom:   {t.child} -> {t.url}", flush=True)


def cmd_supervise(args: argparse.Namespace) -> int:
    """A GPU host: one sampler per visible GPU and the decoders asked for, kept
    running until SIGINT/SIGTERM."""
    from services.ops.children import fork_servers, host_children, metrics_targets, restart_policy, stop_order
    from services.ops.supervisor import Supervisor
    from services.telemetry import logs
    from services.telemetry.metrics import targets_path, write_targets

    settings = _settings(args)
    kernel = settings.kernel
    if not kernel.database_url or not kernel.nats_url:
        print("darkroom: set DARKROOM_DATABASE_URL and DARKROOM_NATS_URL", file=sys.stderr)
        return 2
    logs.configure(kernel.log_level, service="supervise", fmt=kernel.log_format)
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    supervisor = Supervisor(restart_policy(settings), forks=fork_servers(settings))
    for child in host_children(settings, decoders=args.decoders, cpu_samplers=args.cpu_workers):
        supervisor.add(child)
    supervisor.start()
    targets = metrics_targets(supervisor.children.values())
    write_targets(targets_path(kernel.data_dir), targets)
    print(f"darkroom: supervising {', '.join(supervisor.children)}", flush=True)
    _print_metrics(targets, kernel.data_dir)
    try:
        stopped.wait()
    finally:
        supervisor.stop(stop_order(list(supervisor.children)), timeout=kernel.shutdown_grace_s + 5.0)
        write_targets(targets_path(kernel.data_dir), [])
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from services.db.migrate import upgrade

    kernel = KernelSettings.from_env()
    if not kernel.database_url:
        print("darkroom: set DARKROOM_DATABASE_URL", file=sys.stderr)
        return 2
    upgrade(kernel.database_url)
    return 0


def cmd_build_tiny_model(args: argparse.Namespace) -> int:
    from services.models.tiny import build_tiny_model

    print(build_tiny_model(Path(args.path)))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import importlib

    importlib.import_module(f"{SERVICE_MODULES[args.service]}.service").main()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="darkroom", description="Diffusion image generation on a fleet of GPUs")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start the whole stack on this machine")
    up.add_argument("--data-dir", help="where PostgreSQL, JetStream and models live (default ~/.darkroom)")
    up.add_argument("--port", type=int, help="gateway port (default 50051)")
    up.add_argument("--http-port", type=int, help="HTTP API port (default 8080; 0: a free one)")
    up.add_argument("--cpu-workers", type=int, default=1, help="sampler processes when there is no GPU")
    up.add_argument("--decoders", type=int, default=1, help="VAE decoder processes")
    up.add_argument(
        "--model-store",
        action="store_true",
        help="start a local S3 server (seaweedfs) for store: models, unless DARKROOM_MODEL_STORE_URL names one",
    )
    up.set_defaults(func=cmd_up, demo_prompt=None)

    sup = sub.add_parser(
        "supervise",
        help="run and keep running this GPU host's samplers and decoders (needs the database and NATS URLs)",
    )
    sup.add_argument("--decoders", type=int, default=1, help="VAE decoder processes on this host")
    sup.add_argument("--cpu-workers", type=int, default=1, help="sampler processes when there is no GPU")
    sup.add_argument("--data-dir", help="where models, logs and liveness files live (default ~/.darkroom)")
    sup.set_defaults(func=cmd_supervise)

    demo = sub.add_parser("demo", help="start the stack, generate one image, save it and stop")
    demo.add_argument("prompt", nargs="?", default="a lighthouse on a cliff at dusk")
    demo.add_argument("--data-dir")
    demo.add_argument("--port", type=int, default=0, help="gateway port (default: a free one)")
    demo.add_argument("--http-port", type=int, default=0, help="HTTP API port (default: a free one)")
    demo.add_argument("--cpu-workers", type=int, default=1)
    demo.add_argument("--decoders", type=int, default=1)
    generate_cli.add_options(demo)
    demo.set_defaults(func=lambda a: cmd_up(argparse.Namespace(**{**vars(a), "demo_prompt": a.prompt})))

    generate_cli.add_commands(sub)

    serve = sub.add_parser("serve", help="run one service (settings from DARKROOM_* variables)")
    serve.add_argument("service", choices=sorted(SERVICE_MODULES))
    serve.set_defaults(func=cmd_serve)

    migrate = sub.add_parser("migrate", help="apply database migrations to DARKROOM_DATABASE_URL")
    migrate.set_defaults(func=cmd_migrate)

    from services.ops import tenants_cli

    tenants_cli.add_commands(sub, lambda args: tenants_cli.run(args, _settings(args)))
    from services.ops import adapters_cli

    adapters_cli.add_commands(sub, lambda args: tenants_cli.run(args, _settings(args)))

    from services.ops import certs_cli

    certs_cli.add_commands(sub, lambda args: certs_cli.run(args, _settings(args)))

    from services.ops import models_cli

    models_cli.add_commands(sub, lambda args: models_cli.run(args, _settings(args)))

    tiny = sub.add_parser("build-tiny-model", help="build the tiny random-weight model into a directory")
    tiny.add_argument("path")
    tiny.set_defaults(func=cmd_build_tiny_model)

    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except SettingsError as exc:
        print(f"darkroom: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
