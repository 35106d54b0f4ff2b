"""The placement benchmark prints the same figures, every table row and verdict
line, for the same scenario and trace seeds, whatever the hash seed and the
number of processes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests import fleets
from tests.unit.test_ideal import TINY

REPO = Path(__file__).resolve().parents[2]


def bench(scenario: Path, *, hash_seed: int, processes: int) -> str:
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed)}
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "placement.py"),
            "--scenario",
            str(scenario),
            "--seeds",
            "2",
            "--processes",
            str(processes),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_same_scenario_and_seeds_print_the_same_figures(tmp_path: Path) -> None:
    scenario = fleets.write(tmp_path / "tiny.toml", TINY)
    one = bench(scenario, hash_seed=1, processes=1)
    two = bench(scenario, hash_seed=2, processes=2)
    assert one.strip() and one == two
    lines = one.strip().splitlines()
    assert re.fullmatch(r"p99_ratio_vs_best_seed=\d+\.\d\d", lines[-2])
    assert re.fullmatch(r"sustainable_load=\d\.\d\d/\d\.\d\d", lines[-1])
    assert lines[-3].startswith("scenario tiny: sustainable=")
    # Every policy, the ideal included, has its rows, each a median and the worst seed.
    for policy in ("darkroom", "round-robin", "shortest-queue", "load-ratio", "model-affinity", "ideal"):
        assert re.search(rf"^\| {policy} \| 85% \| \d\.\d{{3}} \(\d\.\d{{3}}\) \|", one, re.MULTILINE)
