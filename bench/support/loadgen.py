"""An open-loop load generator for the public API, run as its own process by
``bench/controlplane.py``: jobs arrive on a schedule fixed by the seed (Poisson at
the given rate), whether or not earlier ones have finished, and each is followed
to its last image byte through ``StreamJob`` or by polling ``GetJob``.

    python bench/support/loadgen.py CONFIG.json RESULT.json

It writes one record per job: when it was due, when its submit went out (the
generator's own lag is the difference), how long the submit took, and how long
from the submit to the last byte of its last image.

It has no ``--smoke`` of its own: it needs a running gateway, and
``python bench/controlplane.py --smoke`` runs it against one."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import grpc

from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc

TERMINAL = {pb.JOB_STATUS_SUCCEEDED, pb.JOB_STATUS_FAILED, pb.JOB_STATUS_CANCELLED, pb.JOB_STATUS_EXPIRED}


@dataclass(frozen=True)
class Config:
    address: str
    rate: float  # jobs per second, on average
    seconds: float  # how long jobs keep arriving
    seed: int
    mode: str  # "stream" or "poll"
    model: str
    size: int
    steps: int
    poll_s: float = 0.002
    # A job not finished this long after its submit counts as not completed.
    patience_s: float = 60.0
    label: str = ""


@dataclass
class Record:
    index: int
    due_s: float  # when the schedule said it arrives, from the run's start
    sent_s: float  # when its submit went out
    submit_s: float = 0.0  # the submit's round trip
    end_to_end_s: float = 0.0  # submit sent to the last image byte
    finished_s: float = 0.0  # when the last byte arrived, from the run's start
    status: str = ""
    job_id: str = ""
    error: str = ""
    # Seconds per stage, from the job's own timings (its final Job message).
    stages: dict[str, float] = field(default_factory=dict)


def arrivals(rate: float, seconds: float, seed: int) -> list[float]:
    """Poisson arrival times in [0, seconds), the same for the same seed."""
    rng = random.Random(seed)
    times: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return times
        times.append(t)


def request(config: Config, index: int) -> pb.SubmitJobRequest:
    return pb.SubmitJobRequest(
        model=config.model,
        prompt=f"bench job {index}",
        width=config.size,
        height=config.size,
        steps=config.steps,
        seed=config.seed * 1_000_003 + index,
        num_images=1,
        idempotency_key=f"{config.label}-{config.seed}-{index}",
    )


async def stream(stub: image_generation_pb2_grpc.ImageGenerationStub, job_id: str) -> pb.Job:
    """Follows the job to its terminal event; returns the job as it ended."""
    async for event in stub.StreamJob(pb.StreamJobRequest(job_id=job_id)):
        if event.HasField("terminal"):
            return event.terminal
    raise RuntimeError("the stream ended without a terminal event")


async def poll(stub: image_generation_pb2_grpc.ImageGenerationStub, job_id: str, every_s: float) -> pb.Job:
    """Reads the job until it has ended (its images come with that read)."""
    while True:
        job = await stub.GetJob(pb.GetJobRequest(job_id=job_id))
        if job.status in TERMINAL:
            return job
        await asyncio.sleep(every_s)


def stage_seconds(job: pb.Job) -> dict[str, float]:
    durations = job.stage_durations
    return {
        field.name.removesuffix("_seconds"): getattr(durations, field.name)
        for field in durations.DESCRIPTOR.fields
        if durations.HasField(field.name)
    }


async def one_job(
    stub: image_generation_pb2_grpc.ImageGenerationStub, config: Config, record: Record, start: float
) -> None:
    sent = time.perf_counter()
    record.sent_s = sent - start
    try:
        reply = await stub.SubmitJob(request(config, record.index), timeout=30)
        record.job_id = reply.job_id
        record.submit_s = time.perf_counter() - sent
        follow = stream(stub, reply.job_id) if config.mode == "stream" else poll(stub, reply.job_id, config.poll_s)
        job = await asyncio.wait_for(follow, config.patience_s)
        now = time.perf_counter()
        record.end_to_end_s = now - sent
        record.finished_s = now - start
        record.status = pb.JobStatus.Name(job.status).removeprefix("JOB_STATUS_")
        record.stages = stage_seconds(job)
    except grpc.aio.AioRpcError as exc:
        record.error = f"{exc.code().name}: {exc.details()}"
    except TimeoutError:
        record.error = f"not finished in {config.patience_s:.0f}s"


async def run(config: Config) -> list[Record]:
    due = arrivals(config.rate, config.seconds, config.seed)
    # A few connections: one HTTP/2 connection serializes every call on one socket.
    channels = [grpc.aio.insecure_channel(config.address) for _ in range(4)]
    stubs = [image_generation_pb2_grpc.ImageGenerationStub(ch) for ch in channels]
    records = [Record(i, t, 0.0) for i, t in enumerate(due)]
    tasks = []
    start = time.perf_counter()
    for record in records:
        pause = start + record.due_s - time.perf_counter()
        if pause > 0:
            await asyncio.sleep(pause)
        tasks.append(asyncio.create_task(one_job(stubs[record.index % len(stubs)], config, record, start)))
    await asyncio.gather(*tasks)
    for ch in channels:
        await ch.close()
    return records


def main() -> None:
    config_path, result_path = sys.argv[1], sys.argv[2]
    config = Config(**json.loads(Path(config_path).read_text()))
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    records = asyncio.run(run(config))
    result: dict[str, Any] = {"config": asdict(config), "records": [asdict(r) for r in records]}
    Path(result_path).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
