"""What every fault scenario shares: a stack tuned to notice failures in seconds, a
load of jobs submitted and followed through the gRPC API as a client would, and
one checker of the promise: every accepted job reaches exactly one terminal state,
with exactly its images, seen once by its client, and no process outlives the stack."""

from __future__ import annotations

import collections
import io
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import psutil
import psycopg
from PIL import Image

from services.config.sections import Settings
from services.models.video_encoding import probe_video, read_frames
from services.ops.stack import LocalStack
from services.rpc.client import GeneratedImage, StreamLog, follow, submit
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc
from tests.helpers import env_of, metrics_text

# Failures noticed in seconds rather than the production defaults' tens of seconds.
FAST: dict[str, Any] = {
    "heartbeat_interval_s": 0.5,
    "worker_stale_after_s": 3.0,
    "recovery_interval_s": 0.25,
    "hang_after_s": 5.0,
    "restart_backoff_s": 0.2,
    "restart_backoff_max_s": 2.0,
    "redispatch_after_s": 3.0,
    "dispatch_ack_wait_s": 10.0,
    "shutdown_grace_s": 8.0,
    "outcome_retry_s": 30.0,
    "log_level": "INFO",
}
TERMINAL = {pb.JOB_STATUS_SUCCEEDED, pb.JOB_STATUS_FAILED, pb.JOB_STATUS_CANCELLED, pb.JOB_STATUS_EXPIRED}


def fault_stack(
    data_dir: Path,
    models_dir: Path,
    *,
    database_url: str = "",
    samplers: int = 1,
    decoders: int = 1,
    durable: bool = False,
    **overrides: Any,
) -> LocalStack:
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "models").symlink_to(models_dir, target_is_directory=True)
    base = env_of(data_dir=data_dir, database_url=database_url, gateway_port=0, **{**FAST, **overrides})
    settings = Settings.from_env(base)
    return LocalStack(settings, cpu_workers=samplers, decoders=decoders, durable=durable)


@dataclass
class Followed:
    request: pb.SubmitJobRequest
    job_id: str = ""
    log: StreamLog = field(default_factory=StreamLog)
    results: list[tuple[pb.Job, list[GeneratedImage]]] = field(default_factory=list)
    error: str = ""
    thread: threading.Thread | None = None


class Load:
    """Jobs submitted and each followed on its own thread by the reconnecting client."""

    def __init__(self, channel: grpc.Channel, *, patience_s: float = 120.0) -> None:
        self.patience_s = patience_s
        self.channel = channel
        self.stub = image_generation_pb2_grpc.ImageGenerationStub(channel)
        self.jobs: list[Followed] = []
        self._lock = threading.Lock()
        self._keys = iter(range(10**9))

    @classmethod
    def of(cls, stack: LocalStack, *, patience_s: float = 120.0) -> Load:
        return cls(grpc.insecure_channel(stack.gateway_address), patience_s=patience_s)

    def submit(
        self, n: int, *, width: int = 64, height: int = 64, steps: int = 40, num_images: int = 1, **more: Any
    ) -> list[str]:
        """Submits ``n`` jobs now and starts following them; returns their ids."""
        started = [self.start(width=width, height=height, steps=steps, num_images=num_images, **more) for _ in range(n)]
        for f in started:
            assert f.thread is not None
            while f.thread.is_alive() and not f.job_id and not f.error:
                time.sleep(0.01)
        return [f.job_id for f in started]

    def start(
        self, *, width: int, height: int, steps: int, num_images: int = 1, model: str = "tiny", frames: int = 0
    ) -> Followed:
        """Submits one job from its own thread (a submit may have to wait out an
        outage) and follows it to its end."""
        key = f"fault-{next(self._keys)}-{time.monotonic_ns()}"
        request = pb.SubmitJobRequest(
            model=model,
            frames=frames,
            prompt=f"job {key}",
            width=width,
            height=height,
            steps=steps,
            num_images=num_images,
            seed=len(self.jobs) + 1,
            idempotency_key=key,
        )
        followed = Followed(request)

        def run() -> None:
            try:
                reply = submit(self.stub, request, patience_s=self.patience_s, log=followed.log)
                followed.job_id = reply.job_id
                followed.results.append(follow(self.stub, reply.job_id, patience_s=self.patience_s, log=followed.log))
            except Exception as exc:  # recorded, and the checker fails on it
                followed.error = f"{type(exc).__name__}: {exc}"

        followed.thread = threading.Thread(target=run, daemon=True)
        with self._lock:
            self.jobs.append(followed)
        followed.thread.start()
        return followed

    def wait(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        for f in self.jobs:
            assert f.thread is not None
            f.thread.join(max(0.0, deadline - time.monotonic()))

    def get(self, job_id: str) -> pb.Job:
        return self.stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=10)


@dataclass
class Summary:
    scenario: str
    jobs: int
    succeeded: int
    failed: dict[str, int]
    lost: int
    duplicated: int
    recover_s: float | None
    notes: list[str] = field(default_factory=list)

    def row(self) -> str:
        failed = ", ".join(f"{n} ({why})" for why, n in self.failed.items()) or "0"
        recover = f"{self.recover_s:.1f} s" if self.recover_s is not None else "n/a"
        cells = [self.scenario, self.jobs, self.succeeded, failed, self.lost, self.duplicated, recover]
        return "| " + " | ".join(str(c) for c in cells) + " |"


SUMMARIES: list[Summary] = []


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    with Image.open(io.BytesIO(data)) as img:
        img.load()  # decodes every byte: a truncated PNG fails here
        return img.size


def output_size(data: bytes, frames: int) -> tuple[int, int, int]:
    """An image's (width, height, 1), or an MP4's (width, height, frames), read whole."""
    if frames == 1:
        return (*png_size(data), 1)
    info = probe_video(data)
    if len(read_frames(data)) != info.frames:
        return (info.width, info.height, -1)
    return (info.width, info.height, info.frames)


def db_rows(pg_url: str, ids: list[str]) -> dict[str, dict[str, Any]]:
    with psycopg.connect(pg_url, connect_timeout=5) as conn:
        cur = conn.execute(
            "SELECT j.id, j.status, j.num_images, j.width, j.height, j.frames, j.idempotency_key, j.starts, j.failures,"
            " j.attempt, j.worker_id, j.finished_at, j.scheduled_at,"
            " (SELECT count(*) FROM job_images i WHERE i.job_id = j.id) AS stored"
            " FROM jobs j WHERE j.id = ANY(%s)",
            (ids,),
        )
        names = [d.name for d in cur.description or ()]
        return {row[0]: dict(zip(names, row, strict=True)) for row in cur.fetchall()}


def stream_repeats(events: list[pb.JobEvent]) -> list[str]:
    """Anything delivered twice within one stream: a status repeated back to back,
    a step of progress again within the same run, a second terminal event."""
    problems = []
    last_status = None
    steps: set[int] = set()
    terminals = 0
    for event in events:
        kind = event.WhichOneof("event")
        if kind == "status":
            if event.status == last_status:
                problems.append(f"status {pb.JobStatus.Name(event.status)} twice in a row")
            if event.status in (pb.JOB_STATUS_QUEUED, pb.JOB_STATUS_SCHEDULED):
                steps = set()  # another attempt: its progress starts over
            last_status = event.status
        elif kind == "progress":
            if event.progress.step in steps:
                problems.append(f"progress step {event.progress.step} twice")
            steps.add(event.progress.step)
        elif kind == "terminal":
            terminals += 1
    if terminals > 1:
        problems.append(f"{terminals} terminal events")
    return problems


def check(
    scenario: str,
    pg_url: str,
    load: Load,
    *,
    fault_at: datetime | None = None,
    recovered: Callable[[dict[str, dict[str, Any]]], datetime | None] | None = None,
    all_succeed: bool = True,
    timeout: float = 180.0,
) -> Summary:
    """The shared checker. Waits for every client, then asserts the promise and
    records the scenario's line of the summary table."""
    load.wait(timeout)
    problems: list[str] = []
    stuck = [f for f in load.jobs if f.thread is not None and f.thread.is_alive()]
    problems += [f"client of {f.job_id or f.request.idempotency_key} still waiting" for f in stuck]
    problems += [f"client of {f.job_id or f.request.idempotency_key}: {f.error}" for f in load.jobs if f.error]
    ids = [f.job_id for f in load.jobs if f.job_id]
    rows = db_rows(pg_url, ids)
    lost = [i for i in ids if i not in rows] + [f.request.idempotency_key for f in load.jobs if not f.job_id]
    nonterminal = [i for i, r in rows.items() if r["status"] not in ("SUCCEEDED", "FAILED", "CANCELLED", "EXPIRED")]
    duplicated: set[str] = set()
    with psycopg.connect(pg_url) as conn:
        keys = [f.request.idempotency_key for f in load.jobs]
        for key, n in conn.execute(
            "SELECT idempotency_key, count(*) FROM jobs WHERE idempotency_key = ANY(%s) GROUP BY 1", (keys,)
        ).fetchall():
            if n != 1:
                duplicated.add(key)
                problems.append(f"{n} jobs stored for one submit ({key})")
    failed: collections.Counter[str] = collections.Counter()
    for f in load.jobs:
        if not f.job_id or f.job_id not in rows:
            continue
        row = rows[f.job_id]
        if len(f.results) > 1:
            duplicated.add(f.job_id)
            problems.append(f"{f.job_id}: the client got {len(f.results)} results")
        for n, events in enumerate(f.log.events):
            for problem in stream_repeats(events):
                duplicated.add(f.job_id)
                problems.append(f"{f.job_id} stream {n + 1}: {problem}")
        if row["status"] == "SUCCEEDED":
            if row["stored"] != row["num_images"]:
                duplicated.add(f.job_id)
                problems.append(f"{f.job_id}: {row['stored']} images stored for {row['num_images']}")
            job = load.get(f.job_id)
            sizes = [output_size(i.data, row["frames"]) for i in job.images]
            if sizes != [(row["width"], row["height"], row["frames"])] * row["num_images"]:
                problems.append(f"{f.job_id}: outputs of sizes {sizes}")
            if f.results and [i.data for i in f.results[0][1]] != [i.data for i in job.images]:
                problems.append(f"{f.job_id}: the client's images differ from the stored ones")
        else:
            if row["stored"]:
                duplicated.add(f.job_id)
                problems.append(f"{f.job_id} is {row['status']} with {row['stored']} images stored")
            error = load.get(f.job_id).error
            failed[f"{row['status']}: {error[:60]}"] += 1
    succeeded = sum(1 for r in rows.values() if r["status"] == "SUCCEEDED")
    if all_succeed and succeeded != len(load.jobs):
        problems.append(f"{succeeded} of {len(load.jobs)} succeeded: {dict(failed)}")
    problems += [f"{i} left {rows[i]['status']}" for i in nonterminal]
    problems += [f"{i} lost" for i in lost]
    when = recovered(rows) if recovered else first_success_after(rows, fault_at)
    summary = Summary(
        scenario,
        len(load.jobs),
        succeeded,
        dict(failed),
        len(lost) + len(nonterminal),
        len(duplicated),
        (when - fault_at).total_seconds() if when and fault_at else None,
    )
    SUMMARIES.append(summary)
    assert not problems, "\n".join(problems[:30])
    return summary


def first_success_after(rows: dict[str, dict[str, Any]], when: datetime | None) -> datetime | None:
    """When the first job scheduled after ``when`` succeeded: the system works again."""
    if when is None:
        return None
    done = [
        r["finished_at"]
        for r in rows.values()
        if r["status"] == "SUCCEEDED" and r["scheduled_at"] is not None and r["scheduled_at"] > when
    ]
    return min(done) if done else None


def now() -> datetime:
    return datetime.now(UTC)


def up_metric(stack: LocalStack, name: str, **labels: str) -> float | None:
    """A sample of the stack's own /metrics (what `darkroom up` serves, listed for
    Prometheus as the child ``up``), read over HTTP as Prometheus would; None if absent."""
    from prometheus_client.parser import text_string_to_metric_families

    assert stack.own_metrics is not None, "the stack serves no metrics of its own"
    for family in text_string_to_metric_families(metrics_text(stack.own_metrics.address)):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


def stop_and_check_processes(stack: LocalStack) -> None:
    """Stops the stack; no process it started may outlive it."""
    pids = [pid for c in stack.services.values() for pid in c.pids]
    backends = [p.proc.pid for p in (stack.postgres, stack.nats) if p is not None and p.proc is not None]
    stack.stop()
    alive = []
    for pid in pids + backends:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid}: {' '.join(proc.cmdline())}")
        except psutil.NoSuchProcess:
            pass
    assert not alive, f"processes left behind: {alive}"
