"""Counts the repository reads of the jobs: totals, per lane, per shape."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from services.db.states import JobStatus


@dataclass(frozen=True)
class Totals:
    requests: int
    queued: int
    running: int
    completed: int
    failed: int
    cancelled: int
    expired: int = 0


@dataclass(frozen=True)
class ActiveCount:
    """One tenant's jobs not yet ended: waiting, and held by workers."""

    queued: int
    running: int


@dataclass(frozen=True)
class LaneCount:
    """How many jobs are in one state in one lane, and when the oldest was submitted."""

    status: JobStatus
    lane: str
    count: int
    oldest: datetime


@dataclass(frozen=True)
class ShapeCount:
    """How many jobs of one shape: for demand and for the work queued ahead."""

    model: str
    width: int
    height: int
    steps: int
    num_images: int
    count: int
    frames: int = 1  # of each output (a video's)


@dataclass(frozen=True)
class SubmittedCount:
    """How many jobs of one shape and lane were submitted in one half of the
    warm-set planner's demand window (or before it, and are still queued)."""

    model: str
    width: int
    height: int
    steps: int
    num_images: int
    lane: str
    newer: bool  # in the newer half of the window
    count: int
    backlog: bool = False  # submitted before the window and still queued
    frames: int = 1  # of each output (a video's)
