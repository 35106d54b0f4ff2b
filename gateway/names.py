"""The names a call gives (a job's id, a model's, a lane's, an idempotency key) held
to their lengths before anything else reads them: a message may carry megabytes of
any of them, which would otherwise reach a query, a log line and an error message
that echoes it (past gRPC's limit on a status's size, the client would get no
answer at all)."""

from __future__ import annotations

from google.protobuf.message import Message

from services.db.records import MAX_IDEMPOTENCY_KEY, MAX_JOB_ID, MAX_LANE_NAME, MAX_MODEL_NAME
from services.errors import FieldViolation, InvalidArgument

LENGTHS = {"job_id": MAX_JOB_ID, "model": MAX_MODEL_NAME, "lane": MAX_LANE_NAME, "idempotency_key": MAX_IDEMPOTENCY_KEY}


def check_lengths(request: Message) -> None:
    """InvalidArgument naming each of ``request``'s names longer than it may be."""
    fields = request.DESCRIPTOR.fields_by_name
    bad = [
        FieldViolation(name, f"is {len(value)} characters; at most {most} are taken")
        for name, most in LENGTHS.items()
        if name in fields and len(value := getattr(request, name)) > most
    ]
    if bad:
        raise InvalidArgument(bad)
