"""A service imports without the garbage collector and runs with it: collecting while
torch and diffusers import freed nothing and took a fifth of a stack's start
(docs/benchmarks.md); a collector left off would leak every cycle the service makes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.ops.lifecycle import EXIT_BAD_SETTINGS

REPO = Path(__file__).resolve().parents[2]

# Runs a service's ``__main__`` as ``python -m`` would, its settings bad so that it
# stops at once, and prints how many collections ran before run_service began.
_PROBE = """
import gc, runpy, sys
collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
from services.ops import lifecycle
imports_done = lifecycle.imports_done
def probed():
    print("collections while importing:", len(collections), flush=True)
    imports_done()
lifecycle.imports_done = probed
collections.clear()  # the probe's own imports ran with the collector on
try:
    runpy.run_module(sys.argv[1], run_name="__main__", alter_sys=True)
finally:
    print("collector on:", gc.isenabled(), "frozen:", gc.get_freeze_count() > 0, flush=True)
"""


def probed(service: str, probe: str = _PROBE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", probe, service],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "DARKROOM_LOG_LEVEL": "LOUDLY"},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("service", ["gateway", "scheduler", "gpu_worker", "vae_worker", "http_api"])
def test_a_service_imports_without_collecting_and_runs_with_the_collector_on(service: str) -> None:
    done = probed(service)
    assert done.returncode == EXIT_BAD_SETTINGS, done.stderr
    assert "DARKROOM_LOG_LEVEL" in done.stderr
    assert "collections while importing: 0\n" in done.stdout, done.stdout
    assert "collector on: True frozen: True\n" in done.stdout, done.stdout


def test_the_probe_sees_collections_where_the_collector_runs_while_importing() -> None:
    """The probe above can fail: importing the same modules with the collector on collects."""
    probe = _PROBE.replace("runpy.run_module(", "gc.enable(); import scheduler.service; runpy.run_module(")
    done = probed("scheduler", probe)
    assert "collections while importing: 0\n" not in done.stdout, done.stdout


@pytest.mark.parametrize("service", ["gateway", "scheduler", "http_api"])
def test_a_control_plane_service_imports_no_torch(service: str) -> None:
    """The gateway, the scheduler and the HTTP API are forked from the fork server
    that imported no torch (services/ops/forkserver.py): one that imports it pays
    about 2 CPU seconds at each start and holds its pages. (The gateway once did,
    through the adapters' family table: services/models/adapters/families.py.)"""
    probe = f"import sys, {service}.service; print(sorted(m for m in ('torch', 'diffusers') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
