"""The states a job and a worker can be in. Stored as their string values."""

from __future__ import annotations

import enum


class JobStatus(enum.StrEnum):
    QUEUED = "QUEUED"
    SCHEDULED = "SCHEDULED"
    RUNNING = "RUNNING"
    DECODING = "DECODING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    EXPIRED = "EXPIRED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED})
# The states in which a job belongs to one worker (``jobs.worker_id``).
HELD = frozenset({JobStatus.SCHEDULED, JobStatus.RUNNING, JobStatus.DECODING})
# Held and started: losing the worker now costs the attempt.
STARTED = frozenset({JobStatus.RUNNING, JobStatus.DECODING})


class WorkerStatus(enum.StrEnum):
    STARTING = "starting"  # registered, loading its models
    READY = "ready"  # takes work
    DRAINING = "draining"  # finishing what it runs, taking nothing new
    UNHEALTHY = "unhealthy"  # alive but not fit for work; its supervisor restarts it
    GONE = "gone"  # deregistered, or pruned
    # Never stored: how GetStats reports a worker whose heartbeat is stale.
    UNRESPONSIVE = "unresponsive"


class WorkerKind(enum.StrEnum):
    SAMPLER = "sampler"
    DECODER = "decoder"
