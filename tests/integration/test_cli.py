"""`darkroom up` starts every process, `darkroom generate` writes the PNG through it,
and SIGTERM stops everything, leaving no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from services.embedded import free_port
from tests.helpers import png_size, wait_for

pytestmark = pytest.mark.integration


def test_up_generate_and_stop(tmp_path: Path, postgres, models_dir: Path) -> None:
    from tests.conftest import fresh_database

    data = tmp_path / "data"
    data.mkdir()
    (data / "models").symlink_to(models_dir, target_is_directory=True)
    port = free_port()
    # Its own nats-server (embedded, since no URL is set) and its own database.
    env = {**os.environ, "DARKROOM_DATABASE_URL": fresh_database(postgres)}
    env.pop("DARKROOM_NATS_URL", None)
    log = open(tmp_path / "up.log", "wb")
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--data-dir", str(data), "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_for(
            lambda: (tmp_path / "up.log").read_text(errors="replace"),
            lambda text: "gateway listening" in text or up.poll() is not None,
            timeout=180,
            what="darkroom up",
        )
        assert up.poll() is None, (tmp_path / "up.log").read_text()
        children = psutil.Process(up.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        for module in ("gateway", "scheduler", "gpu_worker", "vae_worker", "nats-server"):
            assert module in names, module
        out = tmp_path / "out.png"
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.cli",
                "generate",
                "a cat",
                "-o",
                str(out),
                "--gateway",
                f"127.0.0.1:{port}",
                "--width",
                "96",
                "--height",
                "128",
                "--steps",
                "3",
                "--seed",
                "5",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert "step 3/3" in result.stderr  # the progress bar, fed by the stream
        assert png_size(out.read_bytes()) == (96, 128)
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if up.poll() is None:
            up.kill()
        log.close()
