"""`darkroom up` starts every process, `darkroom generate` writes the PNG through it,
and SIGTERM stops everything, leaving no process behind."""

from __future__ import annotations

import base64
import io
import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import psutil
import psycopg
import pytest
from PIL import Image

from services.models.video_encoding import probe_video
from services.ops.processes import free_port
from tests.helpers import metrics_text, png_size, wait_for


def runs(proc: psutil.Process, module: str) -> bool:
    """Whether ``proc`` is ``python -m module``: by its arguments, or by its title when
    it was forked from a fork server (services/ops/forkserver.py)."""
    words = " ".join(proc.cmdline()).split()
    return any(a == "-m" and b == module for a, b in itertools.pairwise(words))


pytestmark = pytest.mark.integration


def test_up_generate_and_stop(tmp_path: Path, postgres, models_dir: Path) -> None:
    """Over 30 s under load: `darkroom up` as a user runs it (its own PostgreSQL, NATS and
    services), then the CLI and the OpenAI SDK against it."""
    from tests.conftest import fresh_database

    data = tmp_path / "data"
    data.mkdir()
    (data / "models").symlink_to(models_dir, target_is_directory=True)
    port, http_port = free_port(), free_port()
    # Its own nats-server (embedded, since no URL is set) and its own database.
    env = {**os.environ, "DARKROOM_DATABASE_URL": fresh_database(postgres)}
    env.pop("DARKROOM_NATS_URL", None)
    log = open(tmp_path / "up.log", "wb")
    up = subprocess.Popen(
        [
            *(sys.executable, "-m", "services.ops.cli", "up", "--data-dir", str(data)),
            *("--port", str(port), "--http-port", str(http_port)),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        # A child that dies while the stack starts is restarted, not fatal.
        decoder = wait_for(
            lambda: next((c for c in psutil.Process(up.pid).children(recursive=True) if runs(c, "vae_worker")), None),
            lambda c: c is not None,
            timeout=60,
            what="the decoder to be started",
        )
        assert decoder is not None
        decoder.kill()
        wait_for(
            lambda: (tmp_path / "up.log").read_text(errors="replace"),
            lambda text: "gateway listening" in text or up.poll() is not None,
            timeout=180,
            what="darkroom up",
        )
        assert up.poll() is None, (tmp_path / "up.log").read_text()
        # Every child's metrics, printed and listed for Prometheus.
        printed = wait_for(
            lambda: (tmp_path / "up.log").read_text(errors="replace"),
            lambda text: "darkroom:   gateway -> http://" in text,
            timeout=10,
            what="the metrics list",
        )
        targets = json.loads((data / "prometheus" / "targets.json").read_text())
        children_named = sorted(t["labels"]["child"] for t in targets)
        assert children_named == ["decoder-0", "gateway", "http", "sampler-0", "scheduler", "up"]
        for target in targets:
            [address] = target["targets"]
            assert f"darkroom:   {target['labels']['child']} -> http://{address}/metrics" in printed
            assert "darkroom_build_info" in metrics_text(address)
        children = psutil.Process(up.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        for module in ("gateway", "http_api", "scheduler", "gpu_worker", "vae_worker", "nats-server"):
            assert module in names, module
        out = tmp_path / "out.png"
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.ops.cli",
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
        check_media_commands(tmp_path, port, out)
        # The OpenAI SDK, pointed at `darkroom up`'s HTTP API as the README says.
        assert f"OpenAI-compatible HTTP API on http://127.0.0.1:{http_port}/v1" in printed
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="local", max_retries=0)
        made = sdk.images.generate(prompt="a cat", size="64x64", extra_body={"steps": 2})
        assert made.data is not None and png_size(base64.b64decode(made.data[0].b64_json or "")) == (64, 64)
        # Today's families, through the door and the CLI alike.
        for model in ("tiny-sd3", "tiny-flux", "tiny-flux-schnell", "tiny-qwen-image", "tiny-z-image"):
            made = sdk.images.generate(model=model, prompt="a cat", size="64x96", extra_body={"steps": 2})
            assert made.data is not None and png_size(base64.b64decode(made.data[0].b64_json or "")) == (64, 96)
        # Instruction edits: an image and a sentence (Flux.1 Kontext, Qwen-Image-Edit), through images.edit.
        for model in ("tiny-flux-kontext", "tiny-qwen-image-edit"):
            edited = sdk.images.edit(
                model=model,
                image=("in.png", solid_png((96, 64), (200, 30, 60))),
                prompt="make it night",
                extra_body={"steps": 2},
            )
            assert edited.data is not None and png_size(base64.b64decode(edited.data[0].b64_json or "")) == (96, 64)
        flux = tmp_path / "flux.png"
        generate = [sys.executable, "-m", "services.ops.cli", "generate", "a cat", "-o", str(flux)]
        options = ["--gateway", f"127.0.0.1:{port}", "--model", "tiny-flux", "--width", "80", "--steps", "2"]
        result = subprocess.run([*generate, *options], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert png_size(flux.read_bytes()) == (80, 128)  # the model's default height
        # ... and an instruction edit of it: an image and a sentence.
        night = tmp_path / "night.png"
        generate = [sys.executable, "-m", "services.ops.cli", "generate", "make it night", "-o", str(night)]
        options = ["--gateway", f"127.0.0.1:{port}", "--model", "tiny-flux-kontext", "--image", str(flux)]
        result = subprocess.run([*generate, *options, "--steps", "2"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert png_size(night.read_bytes()) == (80, 128)  # the input's size
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
        assert json.loads((data / "prometheus" / "targets.json").read_text()) == []  # a stopped stack: no targets
    finally:
        if up.poll() is None:
            up.kill()
        log.close()


def test_supervise_keeps_a_hosts_workers_running(tmp_path: Path, postgres) -> None:
    from services.errors import BusError
    from services.ops.embedded_nats import EmbeddedNats
    from services.presence_read import presence_now
    from tests.conftest import fresh_database

    nats_server = EmbeddedNats(tmp_path)
    nats_server.start()
    database_url = fresh_database(postgres)
    env = {
        **os.environ,
        "DARKROOM_DATABASE_URL": database_url,
        "DARKROOM_NATS_URL": nats_server.url,
        "DARKROOM_HEARTBEAT_INTERVAL_S": "0.5",
    }
    supervise = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.ops.cli",
            "supervise",
            "--data-dir",
            str(tmp_path / "data"),
            "--decoders",
            "1",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = database_url.replace("postgresql+psycopg://", "postgresql://")

    def workers() -> dict[str, tuple[str, str, int]]:
        """Each worker's kind, status and restarts, as its heartbeats say."""
        try:
            heard = presence_now([nats_server.url], stale_after_s=60)
        except BusError:
            return {}
        return {w.id: (w.kind.value, w.status.value, w.restarts) for w in heard}

    def registry() -> dict[str, str]:
        """Each worker's status in PostgreSQL's registry: what registering and stopping wrote."""
        with psycopg.connect(url) as conn:
            return {r[0]: r[1] for r in conn.execute("SELECT id, status FROM workers").fetchall()}

    try:
        ready = wait_for(
            workers,
            lambda ws: sorted((k, s) for k, s, _ in ws.values()) == [("decoder", "ready"), ("sampler", "ready")],
            timeout=120,
            what="a sampler and a decoder to register",
        )
        [sampler_id] = [w for w, (kind, _, _) in ready.items() if kind == "sampler"]
        targets = json.loads((tmp_path / "data" / "prometheus" / "targets.json").read_text())
        assert sorted(t["labels"]["service"] for t in targets) == ["decoder", "sampler"]
        for target in targets:
            assert "darkroom_gpu_telemetry_available" in metrics_text(target["targets"][0])
        children = psutil.Process(supervise.pid).children(recursive=True)
        next(c for c in children if runs(c, "gpu_worker")).kill()
        # an empty answer is NATS not answering this once (workers() says so), not the sampler gone
        restarted = lambda ws: ws.get(sampler_id, ("", "", 0))[2] == 1  # noqa: E731
        wait_for(workers, restarted, timeout=120, what="the sampler to be restarted")
        children = psutil.Process(supervise.pid).children(recursive=True)
        supervise.send_signal(signal.SIGTERM)
        assert supervise.wait(60) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
        said = wait_for(workers, bool, timeout=30, what="presence to answer")
        assert {s for _, s, _ in said.values()} == {"gone"}  # said on NATS as they stopped
        assert set(registry().values()) == {"gone"}
    finally:
        if supervise.poll() is None:
            supervise.kill()
        nats_server.stop()


def darkroom(*args: str, port: int) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "services.ops.cli", *args, "--gateway", f"127.0.0.1:{port}"]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def solid_png(size: tuple[int, int], colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


def check_media_commands(tmp_path: Path, port: int, image: Path) -> None:
    """A video, an edit, an inpainting and an upscale through `darkroom generate`
    and `darkroom upscale`, each with its progress bar; a bad file or output named."""
    clip = tmp_path / "clip.mp4"
    video = "--video --frames 9 --fps 8 --width 64 --height 48 --steps 2".split()
    result = darkroom("generate", "waves", *video, "-o", str(clip), port=port)
    assert result.returncode == 0, result.stderr
    assert "step 2/2" in result.stderr and "9 frames at 8 fps" in result.stdout
    info = probe_video(clip.read_bytes())
    assert (info.mime_type, info.frames, info.width, info.height, info.fps) == ("video/mp4", 9, 64, 48, 8.0)

    mask = tmp_path / "mask.png"
    Image.new("L", (96, 128), 255).save(mask)
    for extra in (["--strength", "0.5"], ["--mask", str(mask)]):
        edited = tmp_path / "edited.png"
        result = darkroom(
            "generate", "a door", "--image", str(image), *extra, "--steps", "4", "-o", str(edited), port=port
        )
        assert result.returncode == 0, result.stderr
        assert png_size(edited.read_bytes()) == (96, 128)

    small, big = tmp_path / "small.png", tmp_path / "big.png"
    Image.new("RGB", (32, 24), (200, 40, 90)).save(small)
    result = darkroom("upscale", str(small), "--steps", "2", "-o", str(big), port=port)
    assert result.returncode == 0, result.stderr
    assert "step 2/2" in result.stderr and png_size(big.read_bytes()) == (128, 96)

    missing = darkroom("generate", "x", "--image", str(tmp_path / "none.png"), port=port)
    assert missing.returncode == 2 and "--image" in missing.stderr and "No such file" in missing.stderr
    wrong = darkroom("generate", "x", "--video", "-o", str(tmp_path / "clip.avi"), port=port)
    assert wrong.returncode == 2 and ".mp4" in wrong.stderr
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    refused = darkroom("generate", "x", "--image", str(bad), port=port)
    assert refused.returncode == 1 and "INVALID_ARGUMENT" in refused.stderr and "image" in refused.stderr
