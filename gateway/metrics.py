"""The gateway's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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

EXPANSION_SECONDS = Histogram(
    "darkroom_prompt_expansion_seconds",
    "Time to expand one prompt at submit, on the expansion thread (waiting for it not counted), by expander: "
    "template or model.",
    ["expander"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)


PROMPTS_REFUSED = Counter(
    "darkroom_prompts_refused",
    "SubmitJob calls refused because the prompt filter flagged the prompt (content_policy_violation), per lane; "
    'per tenant: darkroom_tenant_refusals_total{reason="content_policy"}.',
    ["lane"],
)
MODERATED = Counter(
    "darkroom_moderated_inputs",
    "Inputs of Moderate calls (POST /v1/moderations) judged, by kind (text or image) and flagged (true or false).",
    ["kind", "flagged"],
)


def count_submit(lane: str, tenant: str, result: str) -> None:
    SUBMITS.labels(lane=lane, result=result).inc()
    TENANT_SUBMITS.labels(tenant=TENANT_LABELS(tenant), result=result).inc()


def count_refusal(reason: str, tenant: str) -> None:
    """A refused call; per tenant too where its key named one."""
    REFUSALS.labels(reason=reason).inc()
    if tenant:
        TENANT_REFUSALS.labels(tenant=TENANT_LABELS(tenant), reason=reason).inc()


def count_prompt_refused(lane: str, tenant: str) -> None:
    """A submit refused for its prompt: per lane, and per tenant as a refusal of reason content_policy."""
    PROMPTS_REFUSED.labels(lane=lane).inc()
    TENANT_REFUSALS.labels(tenant=TENANT_LABELS(tenant), reason="content_policy").inc()
