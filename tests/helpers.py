from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import os
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

import grpc
import nats
import psycopg
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from PIL import Image

from services.bus.connection import connect_nats
from services.bus.credentials import NatsCredentials
from services.config.fields import ENV_PREFIX
from services.config.sections import KernelSettings, Settings
from services.db.worker_records import WorkerRecord
from services.ops.stack import LocalStack
from services.presence_read import presence_now
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc
from services.rpc.server import Server

T = TypeVar("T")
KNOWN = Settings.variables()


async def channel_to(server: Server) -> AsyncIterator[grpc.aio.Channel]:
    """Starts ``server`` (built on port 0, in this process), yields a channel to it,
    and stops it."""
    await server.grpc.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            yield ch
    finally:
        await server.grpc.stop(0)


TERMINAL = {pb.JOB_STATUS_SUCCEEDED, pb.JOB_STATUS_FAILED, pb.JOB_STATUS_CANCELLED, pb.JOB_STATUS_EXPIRED}


# The tiny model, checkpointing every 5 steps, with a first step estimate near what a
# 2-core CPU takes (so that the scheduler sees from the start which jobs are long).
CHECKPOINTED_TINY = """
[models.tiny]
source = "builtin:tiny"
family = "tiny"
dtype = "float32"
vram_mb = 16
max_width = 512
max_height = 512
max_steps = 150
step_ms_512 = 200
load_s = 0.5
checkpoint_every_steps = 5
"""

# The keys of both Wan miniatures, checkpointed every step.
_CHECKPOINTED_WAN = """family = "wan"
dtype = "float32"
min_size = 32
max_width = 256
max_height = 256
size_step = 16
max_steps = 200
max_frames = 33
default_frames = 9
frames_step = 4
default_fps = 8
default_guidance = 5.0
checkpoint_every_steps = 1
"""
# The default registry's miniatures, each checkpointing at every step.
CHECKPOINTED_MEDIA = f"""
[models.tiny]
source = "builtin:tiny"
family = "tiny"
default = true
dtype = "float32"
vram_mb = 16
max_width = 512
max_height = 512
checkpoint_every_steps = 1

[models.tiny-wan]
source = "builtin:tiny-wan"
default = true
vram_mb = 32
{_CHECKPOINTED_WAN}
[models.tiny-wan22]
source = "builtin:tiny-wan22"
vram_mb = 48
{_CHECKPOINTED_WAN}
[models.tiny-upscaler]
source = "builtin:tiny-upscaler"
family = "sd_x4_upscaler"
default = true
dtype = "float32"
vram_mb = 16
min_size = 64
max_width = 512
max_height = 512
default_guidance = 9.0
max_images = 1
"""


def env_of(**values: object) -> dict[str, str]:
    """Settings as a child reads them: ``heartbeat_interval_s=0.5`` is
    ``DARKROOM_HEARTBEAT_INTERVAL_S="0.5"``. A name that is no setting's variable
    fails here rather than being ignored."""
    env = {}
    for name, value in values.items():
        variable = ENV_PREFIX + name.upper()
        assert variable in KNOWN, f"{variable} is not a setting"
        if isinstance(value, bool):
            env[variable] = "true" if value else "false"
        elif isinstance(value, tuple | list | set | frozenset):
            env[variable] = ",".join(str(v) for v in value)
        else:
            env[variable] = str(value)
    return env


def store_values(model_store: Any) -> dict[str, Any]:
    """``make_stack`` values that point a stack at ``model_store`` as `darkroom up
    --model-store` does: the reader's identity, and each role's that the supervisor
    hands its samplers and its gateway instead."""
    return {k.removeprefix(ENV_PREFIX).lower(): v for k, v in model_store.stack_env().items()}


def stub(stack: LocalStack) -> image_generation_pb2_grpc.ImageGenerationStub:
    return image_generation_pb2_grpc.ImageGenerationStub(grpc.insecure_channel(stack.gateway_address))


def wait_for(fetch: Callable[[], T], done: Callable[[T], bool], *, timeout: float, what: str) -> T:
    """Polls ``fetch`` until ``done``: for waiting on another process, with a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last: {value}")
        time.sleep(0.05)


def wait_terminal(
    client: image_generation_pb2_grpc.ImageGenerationStub,
    job_id: str,
    timeout: float = 120,
    metadata: list[tuple[str, str]] | None = None,
) -> pb.Job:
    return wait_for(
        lambda: client.GetJob(pb.GetJobRequest(job_id=job_id), metadata=metadata),
        lambda j: j.status in TERMINAL,
        timeout=timeout,
        what=f"job {job_id} to end",
    )


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    with Image.open(io.BytesIO(data)) as img:
        img.load()  # decodes every byte: a truncated PNG fails here
        return img.size


def count_jobs(stack: LocalStack) -> int:
    url = stack.settings.kernel.database_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM jobs").fetchone()
        assert row is not None
        return int(row[0])


def metrics_text(address: str) -> str:
    """What a process serves Prometheus at ``address`` (host:port)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as reply:
        return str(reply.read().decode())


async def nats_as_operator(kernel: KernelSettings) -> nats.NATS:
    """A connection to the stack's NATS with the operator's credentials (the mesh
    is sealed): what a person's tools use to look at the dispatch stream."""
    credentials = NatsCredentials.of(kernel.mesh_dir, "operator", "operator")
    return await connect_nats(kernel.nats_servers, name="darkroom-test-operator", credentials=credentials)


def workers_heard(kernel: KernelSettings, *, stale_after_s: float = 10.0) -> dict[str, WorkerRecord]:
    """Every worker in the stack's presence bucket now, by id, as the operator reads it."""
    operator = NatsCredentials.of(kernel.mesh_dir, "operator", "operator") if kernel.mesh_dir else None
    return {w.id: w for w in presence_now(kernel.nats_servers, credentials=operator, stale_after_s=stale_after_s)}


def announce_fake_samplers(kernel: KernelSettings, warm: dict[str, tuple[str, ...]]) -> None:
    """Fake samplers (worker id -> its warm models) heard of once on NATS, as a real
    one announces itself; they serve ``tiny``. Each stays live for the stack's
    ``worker_stale_after_s``. Their registration in PostgreSQL is the caller's."""
    from services.bus.presence_board import Announcement, PresenceBoard
    from services.db.states import WorkerKind
    from services.db.worker_records import WorkerHeartbeat

    async def announce() -> None:
        nc = await nats_as_operator(kernel)
        try:
            board = await PresenceBoard.open(nc.jetstream())
            for worker_id, models in warm.items():
                hb = WorkerHeartbeat(worker_id, WorkerKind.SAMPLER, "127.0.0.1:1", "fake", ("tiny",), models)
                await board.announce(Announcement(hb, "fake", time.time()))
        finally:
            await nc.close()

    asyncio.run(announce())


def quota_failure(error: grpc.RpcError) -> error_details_pb2.QuotaFailure:
    """The QuotaFailure of a call refused with RESOURCE_EXHAUSTED."""
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    assert status is not None
    quota = error_details_pb2.QuotaFailure()
    assert any(d.Unpack(quota) for d in status.details)
    return quota


def cli_here(env: Mapping[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``darkroom ARGS`` run in this process with ``env`` as its whole environment, as
    ``python -m services.ops.cli ARGS`` runs it: its exit status and what it printed.
    For commands that start nothing (the model store's): a process of their own
    imports torch and diffusers again, several CPU seconds a call."""
    from services.ops.cli import main

    def run() -> int:
        try:
            return main(list(args))
        except SystemExit as exc:  # argparse's refusals
            return exc.code if isinstance(exc.code, int) else 1

    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            # A thread of its own: the caller's thread may run an event loop (Playwright's
            # sync API does), where the command's asyncio.run would be refused.
            with concurrent.futures.ThreadPoolExecutor(1) as thread:
                status = thread.submit(run).result()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["darkroom", *args], status, out.getvalue(), err.getvalue())
