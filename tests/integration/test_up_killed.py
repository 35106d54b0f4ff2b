"""`darkroom up` killed outright (SIGKILL, the OOM killer): every process it started
dies with it (a parent-death signal), its PostgreSQL stopping cleanly, and the next
`up` on the same data directory starts and finds its jobs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from services.ops.embedded import EmbeddedPostgres
from services.ops.processes import free_port
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc
from tests.helpers import wait_for, wait_terminal

pytestmark = pytest.mark.integration


@pytest.fixture
def data(tmp_path: Path, models_dir: Path) -> Iterator[Path]:
    data = tmp_path / "data"
    data.mkdir()
    (data / "models").symlink_to(models_dir, target_is_directory=True)
    yield data
    EmbeddedPostgres(data).discard()  # as root, its cluster lives outside the temporary directory


def up(data: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    """`darkroom up` with PostgreSQL and nats-server of its own (no URLs set)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DARKROOM_DATABASE_URL", "DARKROOM_NATS_URL")}
    command = [sys.executable, "-m", "services.ops.cli", "up", "--data-dir", str(data), "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen([*command, "--http-port", "0"], env=env, stdout=out, stderr=subprocess.STDOUT)
    text = wait_for(
        lambda: log.read_text(errors="replace"),
        lambda t: "gateway listening" in t or proc.poll() is not None,
        timeout=240,
        what="darkroom up to be ready",
    )
    assert proc.poll() is None, text
    return proc


def generate(port: int) -> pb.Job:
    client = image_generation_pb2_grpc.ImageGenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    reply = client.SubmitJob(pb.SubmitJobRequest(model="tiny", prompt="a cat", width=64, height=64, steps=2))
    return wait_terminal(client, reply.job_id)


def get(port: int, job_id: str) -> pb.Job:
    client = image_generation_pb2_grpc.ImageGenerationStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    return client.GetJob(pb.GetJobRequest(job_id=job_id), timeout=10)


def running(procs: list[psutil.Process]) -> list[str]:
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid}: {' '.join(p.cmdline())}")
        except psutil.NoSuchProcess:
            pass
    return left


def test_up_killed_leaves_no_orphans_and_the_next_up_finds_its_data(data: Path, tmp_path: Path) -> None:
    port = free_port()
    first = up(data, port, tmp_path / "first.log")
    try:
        job = generate(port)
        assert job.status == pb.JOB_STATUS_SUCCEEDED
        children = psutil.Process(first.pid).children(recursive=True)
        names = " ".join(c.name() for c in children)
        assert "postgres" in names and "nats-server" in names, names
        first.kill()
        first.wait()
        wait_for(lambda: running(children), lambda left: not left, timeout=60, what="up's children to die with it")
    finally:
        if first.poll() is None:
            first.kill()
    # Stopped cleanly (SIGINT), the server removed its own lock file.
    assert not (data / "postgres" / "postmaster.pid").exists()

    second = up(data, port, tmp_path / "second.log")
    try:
        kept = get(port, job.job_id)
        assert kept.status == pb.JOB_STATUS_SUCCEEDED and len(kept.images) == 1
        assert generate(port).status == pb.JOB_STATUS_SUCCEEDED
        children = psutil.Process(second.pid).children(recursive=True)
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0
        wait_for(lambda: running(children), lambda left: not left, timeout=30, what="up's children to stop")
    finally:
        if second.poll() is None:
            second.kill()


def test_a_second_up_on_the_same_data_is_refused(data: Path, tmp_path: Path) -> None:
    port = free_port()
    first = up(data, port, tmp_path / "first.log")
    try:
        env = {k: v for k, v in os.environ.items() if k not in ("DARKROOM_DATABASE_URL", "DARKROOM_NATS_URL")}
        command = [sys.executable, "-m", "services.ops.cli", "up", "--data-dir", str(data), "--port", str(free_port())]
        second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        assert second.returncode != 0
        assert f"another `darkroom up` (pid {first.pid}) is running on {data}" in second.stderr
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(60)
