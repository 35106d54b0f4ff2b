"""The scheduler's Prometheus metrics. Jobs by state are counted in PostgreSQL
(``scheduler.job_gauges``): every scheduler replica reports the same figures."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.db.repository import Settled
from services.telemetry.metrics import WAIT_BUCKETS
from services.telemetry.tenant_metrics import TENANT_CREDITS, TENANT_GPU_SECONDS, TENANT_LABELS

JOBS = Gauge(
    "darkroom_jobs",
    "Jobs not yet ended, in each state (QUEUED, SCHEDULED, RUNNING, DECODING), per lane "
    "(every scheduler replica reports the same figures). Ended jobs: darkroom_jobs_finished_total.",
    ["state", "lane"],
)
QUEUE_DEPTH = Gauge("darkroom_queue_depth", "Jobs queued (QUEUED, not yet placed), per lane.", ["lane"])
QUEUE_OLDEST = Gauge(
    "darkroom_queue_oldest_seconds",
    "How long ago the oldest job still queued in the lane was submitted (0: none queued).",
    ["lane"],
)
QUEUE_WAIT = Histogram(
    "darkroom_queue_wait_seconds",
    "How long a job waited queued, from submit (or requeue) to its placement on a GPU.",
    ["lane"],
    buckets=WAIT_BUCKETS,
)
PLACEMENTS = Counter(
    "darkroom_placements",
    "Jobs the scheduler placed, by kind: warm (its model loaded there), cold (it must load), batch (joins a batch"
    " waiting there), seat (joins the batch running there at its next step).",
    ["kind"],
)
PREEMPTIONS = Counter(
    "darkroom_preemptions",
    "Running jobs the scheduler asked to suspend to make room for waiting ones.",
)


def count_settled(settled: Settled) -> None:
    """Per-tenant usage, as a settlement charged it."""
    for tenant, seconds in settled.gpu_seconds.items():
        TENANT_GPU_SECONDS.labels(tenant=TENANT_LABELS(tenant)).inc(seconds)
    for tenant, credits in settled.credits.items():
        TENANT_CREDITS.labels(tenant=TENANT_LABELS(tenant)).inc(credits)
