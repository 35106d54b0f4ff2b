"""What starting the whole stack costs: `darkroom up`'s services (gateway, scheduler, one
sampler, one decoder) on the tiny model, started on a fresh data directory until
ready (its PostgreSQL and NATS started, the sampler warmed up), then stopped,
``--rounds`` times; prints the time to ready and each service's CPU seconds up to
then (imports, settings, connections, migrations checked, the model loaded and
warmed up), medians over the rounds.

On a host without a GPU the services are forked from the process's fork servers
(services/ops/forkserver.py), which import torch, diffusers, gRPC and the rest
once for every stack the process starts: their row is what they spent in each
round (the first round pays the imports). A supervisor restarting a crashed sampler pays its
row again, and the test suite pays the table for each of the stacks it starts
(docs/benchmarks.md).

    python bench/stack_start.py [--rounds 5] [--no-fork-server]
    python bench/stack_start.py --smoke     # CI's check that it still runs: one round

Nothing here is a test; it prints a table for docs/benchmarks.md."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SMOKE = {"rounds": 1}


def main(argv: list[str] | None = None) -> int:
    import psutil

    from services.config.sections import Settings
    from services.ops.postgres_as_root import discard_clusters_of
    from services.ops.stack import LocalStack

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-fork-server", action="store_true", help="start each service as a new process")
    parser.add_argument("--smoke", action="store_true", help=f"small values for CI: {SMOKE}; given options win")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)
    ready_s: list[float] = []
    server_cpu: dict[int, float] = {}  # each fork server's CPU at the last round's end
    cpu_s: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        # Each round's data directory goes with it (as root, its cluster lives beside it).
        temporary = tempfile.TemporaryDirectory(prefix="darkroom-start-", ignore_cleanup_errors=True)
        data = Path(temporary.name)
        settings = Settings.from_env(
            {
                "DARKROOM_DATA_DIR": str(data),
                "DARKROOM_GATEWAY_PORT": "0",
                "DARKROOM_LOG_LEVEL": "WARNING",
                "DARKROOM_FORK_SERVER": "false" if args.no_fork_server else "true",
            }
        )
        stack = LocalStack(settings, cpu_workers=1, decoders=1, durable=False)
        started = time.perf_counter()
        try:
            stack.start()
            ready_s.append(time.perf_counter() - started)
            for name, child in sorted(stack.services.items()):
                assert child.pid is not None, f"{name} is not running"
                times = psutil.Process(child.pid).cpu_times()
                cpu_s.setdefault(name, []).append(times.user + times.system)
            servers = {psutil.Process(c.pid).ppid() for c in stack.services.values() if c.pid} - {os.getpid()}
            if servers:
                spent = 0.0
                for server in servers:
                    times = psutil.Process(server).cpu_times()
                    spent += times.user + times.system - server_cpu.get(server, 0.0)
                    server_cpu[server] = times.user + times.system
                cpu_s.setdefault("fork servers", []).append(spent)
        finally:
            stack.stop()
            discard_clusters_of(data)
            temporary.cleanup()
    how = "each service a new process" if args.no_fork_server else "services forked"
    print(f"stack start, tiny model, {args.rounds} round(s), {how}, medians (fork servers: mean)\n")
    print("| service | CPU s to ready |")
    print("|---|---|")
    for name, seconds in cpu_s.items():
        # The fork servers' imports fall in the first round: spread over the rounds, as a process's stacks share them.
        spent = statistics.mean(seconds) if name == "fork servers" else statistics.median(seconds)
        print(f"| {name} | {spent:.2f} |")
    total = statistics.median([sum(per_round) for per_round in zip(*cpu_s.values(), strict=True)])
    print(f"| all | {total:.2f} |")
    print()
    print("| rounds | ready s, median | ready s, max |")
    print("|---|---|---|")
    print(f"| {args.rounds} | {statistics.median(ready_s):.2f} | {max(ready_s):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
