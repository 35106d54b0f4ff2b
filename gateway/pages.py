"""``ListJobs``'s paging: what a request asks for, and the page token, an opaque
string that names where the page before ended (its last job's creation and id)."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from datetime import datetime

from services.db.records import JobCursor
from services.db.states import JobStatus
from services.errors import FieldViolation, InvalidArgument
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 200
_STATUS_OF = {pb.JobStatus.Value(f"JOB_STATUS_{s.value}"): s for s in JobStatus}


@dataclass(frozen=True)
class PageRequest:
    size: int
    after: JobCursor | None
    statuses: tuple[JobStatus, ...]


def page_request(req: pb.ListJobsRequest) -> PageRequest:
    """What ``req`` asks for, or InvalidArgument naming what is wrong."""
    bad = []
    after = None
    if req.page_token:
        try:
            after = decode(req.page_token)
        except ValueError:
            bad.append(FieldViolation("page_token", "is not a token from ListJobsResponse.next_page_token"))
    unknown = [s for s in req.statuses if s not in _STATUS_OF]
    if unknown:
        bad.append(FieldViolation("statuses", f"unknown or unspecified status {unknown[0]}"))
    if bad:
        raise InvalidArgument(bad)
    size = min(req.page_size, MAX_PAGE_SIZE) if req.page_size else DEFAULT_PAGE_SIZE
    return PageRequest(size, after, tuple(_STATUS_OF[s] for s in req.statuses))


def encode(cursor: JobCursor) -> str:
    return base64.urlsafe_b64encode(f"{cursor.created_at.isoformat()}|{cursor.id}".encode()).decode()


def decode(token: str) -> JobCursor:
    try:
        created_at, sep, job_id = base64.urlsafe_b64decode(token.encode()).decode().partition("|")
        when = datetime.fromisoformat(created_at)
    except (binascii.Error, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"bad page token: {exc}") from exc
    if not sep or not job_id or when.tzinfo is None:
        raise ValueError("bad page token")
    return JobCursor(when, job_id)
