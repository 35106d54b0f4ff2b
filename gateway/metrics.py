"""The gateway's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

# Label values the callers use, so that dashboards and alerts can rely on them.
SUBMIT_RESULTS = ("accepted", "deduplicated", "refused")

SUBMITS = Counter(
    "darkroom_submits",
    "SubmitJob calls that passed validation, per lane, by result: accepted, deduplicated or refused (lane full).",
    ["lane", "result"],
)
STREAMS_OPEN = Gauge("darkroom_streams_open", "StreamJob streams this gateway is serving now.")
REFUSALS = Counter(
    "darkroom_auth_refusals",
    "Calls refused by the gateway, by reason: missing, unknown or revoked key, cross_tenant (another tenant's job), "
    "lane (a lane above the tenant's), max_jobs or rate (a tenant's limit).",
    ["reason"],
)
