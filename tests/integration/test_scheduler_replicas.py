"""Two scheduler processes over one queue: every job is dispatched exactly once."""

from __future__ import annotations

import asyncio
import collections
import json
import uuid

import nats
import psycopg
import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from prometheus_client.parser import text_string_to_metric_families

from services.bus.dispatch import DISPATCH_STREAM
from services.config.sections import KernelSettings
from services.ops.stack import LocalStack
from tests.conftest import make_stack
from tests.helpers import announce_fake_samplers, env_of, metrics_text, nats_as_operator, wait_for

pytestmark = pytest.mark.integration

JOBS = 400
WORKERS = ["fake-a", "fake-b", "fake-c"]


def seed(conn: psycopg.Connection, kernel: KernelSettings) -> None:
    """Fake samplers, registered and heard of on NATS as real ones are, and the jobs."""
    announce_fake_samplers(kernel, {w: ("tiny",) if w != "fake-c" else () for w in WORKERS})
    for w in WORKERS:
        conn.execute(
            "INSERT INTO workers (id, kind, address, device, status, models, warm_models, telemetry, started_at,"
            " last_heartbeat) VALUES (%s, 'sampler', '127.0.0.1:1', 'fake', 'ready', %s, %s, '{}', now(), now())",
            (w, json.dumps(["tiny"]), json.dumps(["tiny"] if w != "fake-c" else [])),
        )
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO jobs (id, status, lane, priority, model, prompt, negative_prompt, width, height, steps,"
            " guidance_scale, seed, num_images, created_at) VALUES (%s, 'QUEUED', 'free', 0, 'tiny', 'p', '',"
            " 64, 64, 2, 7.5, 1, 1, now())",
            [(str(uuid.uuid4()),) for _ in range(JOBS)],
        )


def schedulers_connected(conn: psycopg.Connection) -> int:
    row = conn.execute(
        "SELECT count(DISTINCT application_name) FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name LIKE 'darkroom-scheduler-%'"
    ).fetchone()
    assert row is not None
    return int(row[0])


def placements(metrics_port: int) -> float:
    """The jobs one scheduler placed, from its own Prometheus counter."""
    families = text_string_to_metric_families(metrics_text(f"127.0.0.1:{metrics_port}"))
    counted = (s for f in families if f.name == "darkroom_placements" for s in f.samples)
    return sum(s.value for s in counted if s.name == "darkroom_placements_total")


async def read_dispatches(kernel: KernelSettings) -> list[tuple[str, dict]]:
    nc = await nats_as_operator(kernel)
    js = nc.jetstream()
    sub = await js.pull_subscribe(
        "darkroom.dispatch.>",
        durable="audit",
        stream=DISPATCH_STREAM,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT),
    )
    out = []
    while True:
        try:
            msgs = await sub.fetch(100, timeout=1)
        except (TimeoutError, nats.errors.TimeoutError):
            break
        for m in msgs:
            out.append((m.subject, json.loads(m.data)))
            await m.ack()
    await nc.close()
    return out


def test_two_schedulers_dispatch_every_job_exactly_once(tmp_path, postgres, models_dir) -> None:
    stack: LocalStack = make_stack(tmp_path, postgres, models_dir)
    stack.start_backends()
    stack.settings = stack.settings.with_env(
        env_of(
            worker_backlog=10_000,
            scheduler_batch=16,
            worker_stale_after_s=3600,
            # Jobs seeded into the table send no work event: both replicas find them by
            # looking every 10 ms, never backing off, so that they contend.
            scheduler_interval_s=0.01,
            scheduler_idle_interval_max_s=0.01,
        )
    )
    db_url = stack.settings.kernel.database_url.replace("postgresql+psycopg://", "postgresql://")
    try:
        ports = {"a": stack.metrics_ports.next(), "b": stack.metrics_ports.next()}
        a = stack.add("scheduler-a", "scheduler", env_of(metrics_port=ports["a"]))
        b = stack.add("scheduler-b", "scheduler", env_of(metrics_port=ports["b"]))
        # Both replicas are up before there is work: otherwise the first could drain
        # the queue while the second still starts, and nothing would be contended.
        with psycopg.connect(db_url, autocommit=True) as conn:
            wait_for(lambda: schedulers_connected(conn), lambda n: n == 2, timeout=60, what="both schedulers")
        with psycopg.connect(db_url) as conn:
            seed(conn, stack.settings.kernel)

        def queued() -> int:
            with psycopg.connect(db_url) as conn:
                row = conn.execute("SELECT count(*) FROM jobs WHERE status = 'QUEUED'").fetchone()
                assert row is not None
                return int(row[0])

        wait_for(queued, lambda n: n == 0, timeout=120, what="the queue to empty")
        assert a.running and b.running
        # A pass counts its placements just after its commit empties the queue.
        placed = wait_for(
            lambda: {name: placements(port) for name, port in ports.items()},
            lambda counts: sum(counts.values()) >= JOBS,
            timeout=10,
            what="the placements to be counted",
        )
        dispatches = asyncio.run(read_dispatches(stack.settings.kernel))
        with psycopg.connect(db_url) as conn:
            rows: dict[str, str] = dict(
                conn.execute("SELECT id, worker_id FROM jobs WHERE status = 'SCHEDULED' AND attempt = 1").fetchall()
            )
    finally:
        stack.stop()
    per_job = collections.Counter(body["job_id"] for _, body in dispatches)
    assert len(rows) == JOBS
    assert set(per_job) == set(rows)
    assert max(per_job.values()) == 1, [j for j, n in per_job.items() if n > 1][:5]
    for subject, body in dispatches:
        assert subject == f"darkroom.dispatch.{rows[body['job_id']]}"
        assert body["attempt"] == 1
    assert set(rows.values()) <= set(WORKERS)
    # Both replicas took turns placing jobs, and their counts add up.
    assert placed["a"] > 0 and placed["b"] > 0, placed
    assert placed["a"] + placed["b"] == JOBS, placed
