"""The gateway's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from services.telemetry.tenant_metrics import TENANT_LABELS, TENANT_REFUSALS, TENANT_SUBMITS

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
    "lane (a lane above the tenant's), max_jobs, rate or credits (a tenant's limit).",
    ["reason"],
)


def count_submit(lane: str, tenant: str, result: str) -> None:
    SUBMITS.labels(lane=lane, result=result).inc()
    TENANT_SUBMITS.labels(tenant=TENANT_LABELS(tenant), result=result).inc()


def count_refusal(reason: str, tenant: str) -> None:
    """A refused call; per tenant too where its key named one."""
    REFUSALS.labels(reason=reason).inc()
    if tenant:
        TENANT_REFUSALS.labels(tenant=TENANT_LABELS(tenant), reason=reason).inc()
