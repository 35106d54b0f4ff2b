"""Per-tenant metrics, their label cardinality bounded: a process labels the first
``limit`` tenants it sees by name and the rest ``other``, so that a public
service's thousands of tenants do not become thousands of series."""

from __future__ import annotations

import threading

from prometheus_client import Counter

OTHER = "other"


class TenantLabels:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._named: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant: str) -> str:
        with self._lock:
            if tenant in self._named:
                return tenant
            if len(self._named) < self.limit:
                self._named.add(tenant)
                return tenant
            return OTHER


# Set from DARKROOM_TENANT_METRICS_MAX when a service starts.
TENANT_LABELS = TenantLabels(100)

TENANT_SUBMITS = Counter(
    "darkroom_tenant_submits",
    "SubmitJob calls per tenant, by result: accepted, deduplicated or refused (a limit, its credits, a full lane).",
    ["tenant", "result"],
)
TENANT_REFUSALS = Counter(
    "darkroom_tenant_refusals",
    "Calls refused per tenant whose key was known, by reason: cross_tenant, lane, max_jobs, rate, credits or "
    "content_policy (a prompt the prompt filter flagged).",
    ["tenant", "reason"],
)
TENANT_GPU_SECONDS = Counter(
    "darkroom_tenant_gpu_seconds",
    "GPU-seconds of sampling charged to each tenant's jobs, counted as they are settled.",
    ["tenant"],
)
TENANT_CREDITS = Counter(
    "darkroom_tenant_credits",
    "Credits charged to each tenant's jobs (GPU-seconds times the model's price), counted as they are settled.",
    ["tenant"],
)
