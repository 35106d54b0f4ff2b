"""Every benchmark in bench/ runs its ``--smoke`` mode (small sizes, one round, on the
CPU) and prints the tables its full run prints, so that a benchmark that rots (a
renamed API, a changed record) fails here rather than the next time someone
measures. Every ``bench/*.py`` is such a benchmark; what the benchmarks use that is
not one (the load generator, the fleet's fake samplers' host and timed scheduler, the
stack a bench runs) is in ``bench/support/``, run by the smoke runs of the benchmarks
that use it (``controlplane`` runs the load generator against its gateway).

The scripts start what they need themselves (PostgreSQL, NATS, the services)."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.bench.smoke_runner import clear

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("smoke_runner.py")

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


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every script's smoke run, one after another in one process of their own
    (``tests/bench/smoke_runner.py``: torch, diffusers and the fork servers imported and
    started once, not once a script): where their outputs and exit codes are. A script
    that ends that process (past its time, or crashing it) has its exit code written
    here, and another process runs the scripts after it."""
    out = tmp_path_factory.mktemp("smoke")
    left = list(TABLES)
    # The stacks' data directories (tens of MB each) go where they are removed afterwards.
    with tempfile.TemporaryDirectory(prefix="darkroom-smoke-", ignore_cleanup_errors=True) as tmp:
        while left:
            # A session of its own: whatever a script left running goes with it.
            proc = subprocess.Popen(
                [sys.executable, str(RUNNER), str(out), tmp, *left],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            said, _ = proc.communicate()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            ran = list(itertools.takewhile(lambda script: (out / f"{script}.rc").exists(), left))
            left = left[len(ran) :]
            if left:  # the one it was running when it ended
                ended, left = left[0], left[1:]
                with open(out / f"{ended}.stderr", "a") as err:
                    err.write(f"\nthe smoke runner ended with {proc.returncode} during it:\n{said[-4000:]}")
                (out / f"{ended}.rc").write_text(f"{proc.returncode or 1}\n")
            clear(Path(tmp))  # what an ended runner left there, for the next one
    return out


# The runner's time for every script: 24 of them, the longest 40-70 s on two cores.
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(("script", "headers"), list(TABLES.items()), ids=list(TABLES))
def test_smoke_run_prints_its_tables(smoke_runs: Path, script: str, headers: tuple[str, ...]) -> None:
    """Over 30 s for the benchmarks that start stacks of their own (cold_start: three,
    continuous_stack, media, gpu): each runs its smallest sizes end to end."""
    code = int((smoke_runs / f"{script}.rc").read_text())
    stdout = (smoke_runs / f"{script}.stdout").read_text(errors="replace")
    stderr = (smoke_runs / f"{script}.stderr").read_text(errors="replace")
    assert code == 0, f"bench/{script}.py --smoke exited {code}:\n{stderr[-4000:]}"
    problems = [p for header in headers if (p := table_problem(stdout, header))]
    assert not problems, f"bench/{script}.py --smoke: {problems}\n{stdout[-4000:]}"
