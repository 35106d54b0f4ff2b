"""``ListJobs``'s paging: what a request asks for, and the page token, an opaque
string that names where the page before ended (its last job's creation and id).
Counts and lengths are checked before anything is iterated or decoded: a message
can hold millions of statuses, or megabytes of token."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from datetime import datetime

from gateway.convert import job_message
from services.db.records import JobCursor
from services.db.repository import Repository
from services.db.states import JobStatus
from services.errors import FieldViolation, InvalidArgument
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 200
_STATUS_OF = {pb.JobStatus.Value(f"JOB_STATUS_{s.value}"): s for s in JobStatus}
# The most statuses a filter may list: each status once.
MAX_STATUSES = len(_STATUS_OF)
# The longest page token taken: one names a time and a job id, well under this.
MAX_PAGE_TOKEN = 256


@dataclass(frozen=True)
class PageRequest:
    size: int
    after: JobCursor | None
    statuses: tuple[JobStatus, ...]


def page_request(req: pb.ListJobsRequest) -> PageRequest:
    """What ``req`` asks for, or InvalidArgument naming what is wrong."""
    _within_bounds(req)
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
    return PageRequest(size, after, tuple(dict.fromkeys(_STATUS_OF[s] for s in req.statuses)))


def _within_bounds(req: pb.ListJobsRequest) -> None:
    """InvalidArgument, before anything is iterated or decoded, for more statuses than
    there are or a token longer than any this gateway makes."""
    bad = []
    if len(req.statuses) > MAX_STATUSES:
        bad.append(
            FieldViolation(
                "statuses", f"lists {len(req.statuses)}; at most {MAX_STATUSES}, each status once, are taken"
            )
        )
    if len(req.page_token) > MAX_PAGE_TOKEN:
        bad.append(FieldViolation("page_token", "is not a token from ListJobsResponse.next_page_token"))
    if bad:
        raise InvalidArgument(bad)


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


async def jobs_page(repo: Repository, tenant: str, req: pb.ListJobsRequest) -> pb.ListJobsResponse:
    """The tenant's page of jobs ``req`` asks for, and the token of the next if there is one."""
    asked = page_request(req)
    # One more than the page: whether there is a page after it.
    jobs = await repo.jobs.page(tenant, statuses=asked.statuses, after=asked.after, limit=asked.size + 1)
    response = pb.ListJobsResponse(jobs=[job_message(job) for job in jobs[: asked.size]])
    if len(jobs) > asked.size:
        last = jobs[asked.size - 1]
        response.next_page_token = encode(JobCursor(last.created_at, last.id))
    return response
