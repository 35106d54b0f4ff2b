"""Every benchmark in bench/ runs its ``--smoke`` mode (small sizes, one round, on the
CPU) and prints the tables its full run prints, so that a benchmark that rots (a
renamed API, a changed record) fails here rather than the next time someone
measures. Every ``bench/*.py`` is such a benchmark; what the benchmarks use that is
not one (the load generator, the fleet's fake samplers' host and timed scheduler, the
stack a bench runs) is in ``bench/support/``, run by the smoke runs of the benchmarks
that use it (``controlplane`` runs the load generator against its gateway).

The scripts start what they need themselves (PostgreSQL, NATS, the services)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from services.ops.postgres_as_root import discard_clusters_of

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240

# Per script, the start of each table's header row: the tables its full run prints.
TABLES: dict[str, tuple[str, ...]] = {
    "controlplane": (
        "| per job p50 ms | per job p99 ms |",
        "| offered jobs/s | completed jobs/s |",
        "| load | client | jobs/s | completed |",
        "| offered jobs/s | service | CPU ms/job |",
    ),
    "fairness": ("| load | seed | run |", "| load | light p99 with heavy / alone, fair |"),
    "http_overhead": ("| path | median s | p90 s |",),
    "media": ("| model | size | frames | steps |",),
    "placement": ("| policy | load | jobs/s |",),
    "parallel": ("| model | size | steps | frames | devices |", "| load | layout | video p50 s |"),
    "continuous_batching": ("| load | mode | img/s |", "| load | p50 at-start / continuous |"),
    "continuous_stack": ("| load | mode | offered jobs/s |", "| load | p50 at-start / continuous |"),
    "prompt_filter": ("| prompts | characters, mean | p50 µs | p99 µs |", "| prompt | filter | p50 ms | p99 ms |"),
    "preemption": ("| round | suspended after s |",),
    "tracing": ("| hook | no endpoint | endpoint |",),
    "gpu": (
        "| model | size | steps | batch |",
        "| model | size | steps | options | N |",
        "| model | size | steps | options | bare s (sample + local decode) |",
        "| model | size | steps | option | resolved |",
    ),
    "checkpoint": ("| uninterrupted s | capture ms, median |",),
    "compile_time": ("| model | backend | whole s | regional s |",),
    "step_cache": ("| model | size | steps | batch | step_cache |",),
    "latency_probe": ("| jobs | client p50 ms |", "| service | CPU ms/job |"),
    "adapters": ("| model | size | steps | batch | rank |", "| adapters | load ms (files to slot) |"),
    "fleet_load": ("| N samplers | hosts | PG conns idle / peak |", "| kind |"),
    "expansion": ("| expander | model | load s |",),
    "image_filter": ("| model | size | device | decoder ms/image, filter off |",),
    "model_store": ("| source | blobs | GB | streams | range MB |",),
    "cold_start": ("| host | first image (s) | from the store (MB) | from peers (MB) |",),
    "stack_start": ("| service | CPU s to ready |", "| rounds | ready s, median | ready s, max |"),
}


def table_problem(stdout: str, header: str) -> str | None:
    """What is wrong with the table whose header row starts with ``header``: missing,
    no separator line under its header, or no data row; None when it is all there."""
    lines = stdout.splitlines()
    at = next((i for i, line in enumerate(lines) if line.startswith(header)), None)
    if at is None:
        return f"no table whose header starts {header!r}"
    if at + 1 >= len(lines) or not lines[at + 1].startswith("|---"):
        return f"no |--- line under {header!r}"
    if at + 2 >= len(lines) or not lines[at + 2].startswith("| ") or lines[at + 2].startswith("|---"):
        return f"no data row under {header!r}"
    return None


def test_every_benchmark_has_its_smoke_run_here() -> None:
    """A script in ``bench/`` is a benchmark with ``--smoke``, and its tables are listed
    above; a helper that is not one goes in ``bench/support/``."""
    scripts = {path.stem for path in (REPO / "bench").glob("*.py")} - {"__init__"}
    assert scripts == set(TABLES), (
        f"bench/ scripts without a smoke run here: {sorted(scripts - set(TABLES))}; "
        f"listed here but not in bench/: {sorted(set(TABLES) - scripts)}"
    )


@pytest.mark.parametrize(("script", "headers"), list(TABLES.items()), ids=list(TABLES))
def test_smoke_run_prints_its_tables(script: str, headers: tuple[str, ...]) -> None:
    """Over 30 s for the benchmarks that start stacks of their own (cold_start: three,
    continuous_stack, media, gpu): each runs its smallest sizes end to end."""
    # The stacks' data directories (tens of MB each) go where they are removed afterwards.
    with tempfile.TemporaryDirectory(prefix="darkroom-smoke-", ignore_cleanup_errors=True) as tmp:
        # A session of its own: on a timeout the stack it started goes with it.
        proc = subprocess.Popen(
            [sys.executable, f"bench/{script}.py", "--smoke"],
            cwd=REPO,
            env={**os.environ, "TMPDIR": tmp},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            pytest.fail(f"bench/{script}.py --smoke ran past {TIMEOUT_S} s:\n{stderr[-4000:]}")
        finally:
            discard_clusters_of(Path(tmp))  # as root, a stack's cluster lives outside its data directory
    assert proc.returncode == 0, f"bench/{script}.py --smoke exited {proc.returncode}:\n{stderr[-4000:]}"
    problems = [p for header in headers if (p := table_problem(stdout, header))]
    assert not problems, f"bench/{script}.py --smoke: {problems}\n{stdout[-4000:]}"
