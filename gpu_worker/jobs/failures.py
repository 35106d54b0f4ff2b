"""What a failed attempt means, decided from what ended it, and whether failures in a
row say that this worker (its GPU, its driver) is not fit for work. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.adapters.slots import SlotsFull
from gpu_worker.decoding.decoders import DecodeUnavailable
from gpu_worker.denoising.group_mesh import GroupBroken
from gpu_worker.denoising.members import BadOutput
from services.errors import InvalidArgument, StoreUnavailable
from services.models.adapters.lora_files import AdapterError
from services.models.store.errors import ModelNotInStore, ModelStoreUnavailable


@dataclass(frozen=True)
class Failure:
    error: str  # what the job's record says
    cause: str  # the metrics' label: invalid input, bad output, decoders away, store away, timed out, error
    retryable: bool  # another attempt, on another GPU, may do
    blames_worker: bool  # a sign that this worker is unfit
    traceback: bool = False  # the log shows where it came from
    ends_worker: bool = False  # this worker can run nothing more until it restarts


def classify(exc: Exception) -> Failure:
    if isinstance(exc, InvalidArgument):
        # The job's own fault: another attempt would fail the same way.
        return Failure(str(exc), "invalid input", retryable=False, blames_worker=False)
    error = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, SlotsFull):
        # Every slot held by jobs running here: another attempt, when they are done, may do.
        return Failure(error, "adapter slots full", retryable=True, blames_worker=False)
    if isinstance(exc, AdapterError | ModelNotInStore):
        # An adapter that does not fit the network, or is gone from the store: the
        # job's own, as a refusal at submit would have been.
        return Failure(error, "invalid input", retryable=False, blames_worker=False)
    if isinstance(exc, GroupBroken):
        # Another attempt may do, but not here: a broken group would fail (or take
        # from the queue and fail) every job it is sent until it is re-formed.
        return Failure(error, "group broken", retryable=True, blames_worker=True, ends_worker=True)
    if isinstance(exc, BadOutput):
        return Failure(error, "bad output", retryable=True, blames_worker=True)
    if isinstance(exc, DecodeUnavailable):
        # Decoders being away says nothing about this worker.
        return Failure(error, "decoders away", retryable=True, blames_worker=False, traceback=True)
    if isinstance(exc, StoreUnavailable | ModelStoreUnavailable):
        # Nor does the database or the model store being away (an adapter's
        # manifest unread, with no copy kept): another attempt, once it is back.
        return Failure(error, "store away", retryable=True, blames_worker=False)
    # The GPU, the model: another attempt, on another GPU, may do.
    return Failure(error, "error", retryable=True, blames_worker=True, traceback=True)


def timed_out(model: str, timeout_s: float) -> Failure:
    return Failure(
        f"ran past the {timeout_s:.0f}s timeout of {model}", "timed out", retryable=True, blames_worker=False
    )


class FailureStreak:
    """Attempts in a row that failed for reasons that blame the worker, each counted
    once its failure is stored (one whose write never landed is redelivered, and
    counts when it fails again); a stored result ends the streak. One failure that
    ends the worker (``Failure.ends_worker``) makes it unfit at once, for good."""

    def __init__(self, unfit_after: int) -> None:
        self.unfit_after = unfit_after
        self.count = 0
        self.ended_by: str | None = None

    def failed(self, failure: Failure) -> None:
        if failure.blames_worker:
            self.count += 1

    def ended(self, failure: Failure) -> None:
        """A failure that ends the worker, counted before it is stored: nothing more
        may start here while it is written."""
        if self.ended_by is None:
            self.ended_by = failure.error

    def succeeded(self) -> None:
        self.count = 0

    @property
    def unfit(self) -> bool:
        return self.ended_by is not None or self.count >= self.unfit_after

    def why_unfit(self) -> str:
        if self.ended_by is not None:
            return f"an attempt failed in a way this worker cannot mend ({self.ended_by})"
        return f"{self.count} attempts in a row failed here"
