"""Structured logs: one JSON object per line (or key=value text, for people), and
every line about a job carries its ``job_id`` and ``attempt``.

Code handling one job says so once, with ``about_job``: every line logged inside,
by any module and in tasks started there, carries the job. A line about several
jobs names them in ``job_ids`` (``extra=jobs_fields(...)``)."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from datetime import UTC, datetime

# The job the code running now is about: (job id, attempt or None).
_job: ContextVar[tuple[str, int | None] | None] = ContextVar("darkroom_job", default=None)


@contextlib.contextmanager
def about_job(job_id: str, attempt: int | None = None) -> Iterator[None]:
    token = _job.set((job_id, attempt))
    try:
        yield
    finally:
        _job.reset(token)


def job_fields(job_id: str, attempt: int | None = None) -> dict[str, object]:
    """``extra=`` for one line about a job, logged outside ``about_job``."""
    return {"job_id": job_id, "attempt": attempt}


def jobs_fields(job_ids: Iterable[str]) -> dict[str, object]:
    """``extra=`` for one line about several jobs."""
    return {"job_ids": sorted(job_ids)}


class _JobFilter(logging.Filter):
    """Puts the job the code is about on each record that does not name one."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "job_id"):
            current = _job.get()
            if current is not None:
                record.job_id, record.attempt = current
        return True


def _job_of(record: logging.LogRecord) -> dict[str, object]:
    out: dict[str, object] = {}
    if job_id := getattr(record, "job_id", None):
        out["job_id"] = job_id
        if (attempt := getattr(record, "attempt", None)) is not None:
            out["attempt"] = attempt
    if job_ids := getattr(record, "job_ids", None):
        out["job_ids"] = job_ids
    return out


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
            **_job_of(record),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = _job_of(record)
        if not fields:
            return text
        head, _, rest = text.partition("\n")  # a traceback stays below the fields
        joined = " ".join(f"{k}={','.join(v) if isinstance(v, list) else v}" for k, v in fields.items())
        return f"{head} {joined}" + (f"\n{rest}" if rest else "")


def configure(level: str, *, service: str, fmt: str = "json") -> None:
    """Logging for a service process: to stderr, in ``fmt``, every line with its job."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TextFormatter())
    handler.addFilter(_JobFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)  # a library's warnings are lines like the others
