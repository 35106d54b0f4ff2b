"""Darkroom's exceptions. Each concern has one root; ``services.rpc.status`` maps them
to gRPC status codes in one place."""

from __future__ import annotations

from dataclasses import dataclass


class DarkroomError(Exception):
    """Root of every error Darkroom raises on purpose."""


@dataclass(frozen=True)
class FieldViolation:
    field: str
    description: str


class RequestError(DarkroomError):
    """The caller asked for something that cannot be done as asked."""


class InvalidArgument(RequestError):
    def __init__(self, violations: list[FieldViolation]):
        self.violations = violations
        super().__init__("; ".join(f"{v.field}: {v.description}" for v in violations))


class ContentPolicyViolation(InvalidArgument):
    """A request the content policy refuses (the prompt filter flagged its prompt):
    it names the field, never what matched, so that the refusal teaches nothing
    about how to get round the list."""

    def __init__(self, field: str = "prompt") -> None:
        super().__init__([FieldViolation(field, "violates the content policy")])


class NotFound(RequestError):
    pass


class AlreadyExists(RequestError):
    pass


class Unauthenticated(RequestError):
    pass


class PermissionDenied(RequestError):
    """The caller is known, and may not do this."""


class FailedPrecondition(RequestError):
    """Nothing the caller can change makes this work here until an operator does
    (a feature this deployment was not given what it needs for)."""


@dataclass(frozen=True)
class QuotaViolation:
    subject: str  # whose limit: "tenant:<name>"
    description: str  # which limit, and where the caller stands against it


class ResourceExhausted(RequestError):
    def __init__(self, message: str, retry_after_s: float | None, quota: QuotaViolation | None = None):
        """``retry_after_s`` None: no telling when (no RetryInfo is sent)."""
        self.retry_after_s = retry_after_s
        self.quota = quota
        super().__init__(message)


class StoreError(DarkroomError):
    """The database could not do what was asked; raised at the repository boundary."""


class StoreUnavailable(StoreError):
    """The database cannot be reached right now; the caller may retry."""


class BusError(DarkroomError):
    """JetStream could not take or give a message."""


class ModelError(DarkroomError):
    """A model could not be found, built or loaded."""


class JobInterrupted(DarkroomError):
    """Raised inside the denoising loop, between steps, when the job must stop: it
    was cancelled, ran past its timeout, was handed back or moved on."""


class WorkerSuperseded(DarkroomError):
    """A newer process registered under this worker's id: this one must stop."""


class WorkerIdTaken(DarkroomError):
    """A worker of another kind is registered under this worker's id: two kinds
    sharing an id would answer for each other's presence and jobs."""


class MalformedDispatch(BusError):
    """A dispatch message that cannot be read: it is dropped, never retried."""


class DegenerateOutput(DarkroomError):
    """A model's output is unusable: NaN or infinite values, or (nearly) constant
    ones, as from broken weights or a corrupted GPU context. Another worker may do."""
