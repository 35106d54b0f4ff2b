"""What each service of a running stack spends, read before and after a bench's
jobs: its processes' CPU time (psutil; PostgreSQL with its backends), and, from
each Darkroom service's own ``/metrics``, the statements it sent to PostgreSQL
(``darkroom_db_statements_total``) and the messages it received from NATS and sent
to it (``darkroom_bus_messages_total``). The difference over the jobs completed is
what a job costs each service: ``bench/controlplane.py`` and
``bench/latency_probe.py`` print it. A helper, not a bench: their ``--smoke`` runs
exercise it."""

from __future__ import annotations

import collections
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

# The table's rows, in the order of a job's path; the backends last.
SERVICES = ("gateway", "scheduler", "sampler", "decoder", "postgres", "nats-server")


@dataclass
class Reading:
    """Totals per service at one moment (several processes of one service summed)."""

    cpu_s: dict[str, float] = field(default_factory=dict)
    statements: dict[str, float] = field(default_factory=dict)
    messages_in: dict[str, float] = field(default_factory=dict)
    messages_out: dict[str, float] = field(default_factory=dict)


def processes(stack: Any) -> dict[str, list[psutil.Process]]:
    """Every process of the stack by service: PostgreSQL with its backends."""
    groups: dict[str, list[psutil.Process]] = collections.defaultdict(list)
    for name, child in stack.services.items():
        if child.proc is not None:
            groups[name.split("-")[0]].append(psutil.Process(child.proc.pid))
    if stack.nats is not None and stack.nats.proc is not None:
        groups["nats-server"].append(psutil.Process(stack.nats.proc.pid))
    if stack.postgres is not None and stack.postgres.proc is not None:
        postmaster = psutil.Process(stack.postgres.proc.pid)
        groups["postgres"] += [postmaster, *postmaster.children(recursive=True)]
    return groups


def cpu_seconds(groups: dict[str, list[psutil.Process]]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for name, procs in groups.items():
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass  # a backend that ended: its time is gone with it
        totals[name] = total
    return totals


def read(stack: Any) -> Reading:
    reading = Reading(cpu_seconds(processes(stack)))
    for name, child in stack.services.items():
        port = child.env.get("DARKROOM_METRICS_PORT", "0")
        if port == "0" or child.proc is None:
            continue  # no metrics of its own (a fleet bench's host of many samplers)
        service = name.split("-")[0]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                text = response.read().decode()
        except OSError:
            continue  # not serving them (yet): its counts are missing, shown as such
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "darkroom_db_statements_total":
                    _add(reading.statements, service, sample.value)
                elif sample.name == "darkroom_bus_messages_total":
                    into = reading.messages_in if sample.labels.get("direction") == "in" else reading.messages_out
                    _add(into, service, sample.value)
    return reading


def _add(totals: dict[str, float], service: str, value: float) -> None:
    totals[service] = totals.get(service, 0.0) + value


def per_job(before: Reading, after: Reading, jobs: int) -> dict[str, dict[str, float]]:
    """Per service: CPU ms, statements and messages per job, over ``jobs``."""
    n = max(jobs, 1)

    def each(a: dict[str, float], b: dict[str, float], service: str, scale: float = 1.0) -> float:
        # Known at both readings, or not at all: a count read only after would be a total, not a difference.
        return (b[service] - a[service]) / n * scale if service in a and service in b else float("nan")

    return {
        service: {
            "cpu_ms": each(before.cpu_s, after.cpu_s, service, 1000.0),
            "statements": each(before.statements, after.statements, service),
            "messages_in": each(before.messages_in, after.messages_in, service),
            "messages_out": each(before.messages_out, after.messages_out, service),
        }
        for service in SERVICES
        if service in after.cpu_s
    }


HEADER = "| service | CPU ms/job | statements/job | messages in/job | messages out/job |"


def table_rows(costs: dict[str, dict[str, float]], prefix: str = "") -> list[str]:
    """Rows under ``HEADER`` (with ``prefix`` cells before each, e.g. the load)."""

    def cell(x: float, digits: int) -> str:
        return "-" if x != x else f"{x:.{digits}f}"

    return [
        f"| {prefix}{service} | {cell(c['cpu_ms'], 2)} | {cell(c['statements'], 1)} | "
        f"{cell(c['messages_in'], 1)} | {cell(c['messages_out'], 1)} |"
        for service, c in costs.items()
    ]
