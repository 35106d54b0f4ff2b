"""The metrics: what the dashboard and the rules query exists, GPU gauges never
claim what NVML did not say, job counts become gauges, and the stack's children
each get a port and are listed for Prometheus."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import types
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

from gateway import metrics as gateway_metrics
from gpu_worker import metrics as sampler_metrics
from scheduler import metrics as scheduler_metrics
from scheduler.job_gauges import job_gauges_loop, show
from services.config.sections import KernelSettings, Settings
from services.db.counts import LaneCount
from services.db.states import JobStatus
from services.errors import StoreUnavailable
from services.ops.children import MetricsPorts, child, metrics_target
from services.safety import metrics as safety_metrics
from services.telemetry import metrics, tenant_metrics
from services.telemetry.gpu import THROTTLE_REASONS, GpuReading
from services.telemetry.metrics import Target, observe_gpu, serve_metrics, write_targets
from tests.helpers import env_of
from vae_worker import metrics as decoder_metrics

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "infra" / "grafana" / "darkroom.json"
PROMETHEUS = REPO / "infra" / "prometheus"
METRIC_NAME = re.compile(r"\bdarkroom_[a-z0-9_]+")
# The samples each kind of metric exposes, by suffix (``_created`` is turned off).
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",)}


# Where metrics are defined: the shared ones, then each service's own.
METRIC_MODULES = (
    metrics,
    tenant_metrics,
    safety_metrics,
    gateway_metrics,
    scheduler_metrics,
    sampler_metrics,
    decoder_metrics,
)


def defined() -> list[MetricWrapperBase]:
    return [v for m in METRIC_MODULES for v in vars(m).values() if isinstance(v, MetricWrapperBase)]


def exposed_names() -> set[str]:
    """Every sample name Darkroom's metric modules define."""
    names: set[str] = set()
    for value in defined():
        for family in value.describe():
            names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    return names


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def dashboard_exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, str | dict):
                yield value if isinstance(value, str) else value.get("query", "")
            else:
                yield from dashboard_exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from dashboard_exprs(item)


def test_the_names_carry_their_units_and_a_prefix() -> None:
    names = exposed_names()
    assert names and all(n.startswith("darkroom_") for n in names)
    assert {"darkroom_rpc_requests_total", "darkroom_rpc_duration_seconds_bucket", "darkroom_jobs"} <= names
    for value in defined():
        [family] = value.describe()
        assert family.documentation and len(family.documentation) > 15, family.name
        if family.type == "histogram":
            assert family.name.endswith(("_seconds", "_images")), family.name


def test_every_metric_the_dashboard_queries_is_defined() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    used = {name for expr in dashboard_exprs(dashboard) for name in METRIC_NAME.findall(expr)}
    assert len(used) > 25
    assert used - exposed_names() == set()


def test_the_dashboard_is_a_grafana_model_on_a_chosen_prometheus() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys() and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs), panel["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" and t["expr"] for t in panel["targets"])
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("finished", "state", "queue", "stage", "placement", "cold", "temperature", "memory"):
        assert topic in titles, topic
    for topic in ("utilisation", "throttl", "batch", "decoder", "requeue", "rpc errors"):
        assert topic in titles, topic


def test_every_metric_the_rules_use_is_defined() -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    used = set()
    for rules_file in config["rule_files"]:
        for group in yaml.safe_load((PROMETHEUS / rules_file).read_text())["groups"]:
            for rule in group["rules"]:
                used.update(METRIC_NAME.findall(rule["expr"]))
    assert used and used - exposed_names() == set()


def nvml_reading(**overrides: Any) -> GpuReading:
    values: dict[str, Any] = {
        "name": "NVIDIA H100",
        "source": "nvml",
        "temperature_c": 71.0,
        "vram_total_bytes": 80 * 2**30,
        "vram_used_bytes": 12 * 2**30,
        "utilization_pct": 97.0,
        "power_w": 612.0,
        "power_limit_w": 700.0,
        "sm_clock_mhz": 1755,
        "max_sm_clock_mhz": 1980,
        "throttle_reasons": ("sw_power_cap",),
    }
    return GpuReading(**{**values, **overrides})


def test_a_gpu_reading_sets_every_gauge_in_base_units() -> None:
    observe_gpu("w-full", nvml_reading())
    assert sample("darkroom_gpu_telemetry_available", worker="w-full") == 1
    assert sample("darkroom_gpu_temperature_celsius", worker="w-full") == 71
    assert sample("darkroom_gpu_memory_used_bytes", worker="w-full") == 12 * 2**30
    assert sample("darkroom_gpu_memory_total_bytes", worker="w-full") == 80 * 2**30
    assert sample("darkroom_gpu_utilization_ratio", worker="w-full") == pytest.approx(0.97)
    assert (
        sample("darkroom_gpu_power_watts", worker="w-full"),
        sample("darkroom_gpu_power_limit_watts", worker="w-full"),
    ) == (612, 700)
    assert sample("darkroom_gpu_sm_clock_hertz", worker="w-full") == 1755e6
    assert sample("darkroom_gpu_sm_clock_max_hertz", worker="w-full") == 1980e6
    throttled = {r: sample("darkroom_gpu_throttled", worker="w-full", reason=r) for r in THROTTLE_REASONS.values()}
    assert throttled == {r: (1.0 if r == "sw_power_cap" else 0.0) for r in THROTTLE_REASONS.values()}


def test_without_nvml_the_gauges_are_absent_not_zero() -> None:
    observe_gpu("w-lost", nvml_reading())  # it had NVML once
    observe_gpu("w-lost", GpuReading(unavailable="a CPU worker"))
    assert sample("darkroom_gpu_telemetry_available", worker="w-lost") == 0
    assert sample("darkroom_gpu_temperature_celsius", worker="w-lost") is None
    assert sample("darkroom_gpu_memory_total_bytes", worker="w-lost") is None
    assert sample("darkroom_gpu_throttled", worker="w-lost", reason="sw_power_cap") is None


def test_a_field_nvml_did_not_give_is_absent() -> None:
    observe_gpu("w-part", nvml_reading(power_w=0.0, missing=("power_w", "throttle_reasons")))
    assert sample("darkroom_gpu_power_watts", worker="w-part") is None
    assert sample("darkroom_gpu_throttled", worker="w-part", reason="hw_slowdown") is None
    assert sample("darkroom_gpu_power_limit_watts", worker="w-part") == 700


def test_job_counts_become_gauges_and_an_emptied_lane_reads_zero() -> None:
    now = datetime(2030, 1, 1, tzinfo=UTC)
    counts = [
        LaneCount(JobStatus.QUEUED, "paid", 3, now - timedelta(seconds=42)),
        LaneCount(JobStatus.DECODING, "paid", 7, now - timedelta(hours=1)),
        LaneCount(JobStatus.RUNNING, "batch-lane", 1, now),
    ]
    shown = show(counts, ["paid", "unit-free"], now=now)
    assert shown == {"paid", "unit-free", "batch-lane"}
    assert sample("darkroom_jobs", state="QUEUED", lane="paid") == 3
    assert sample("darkroom_jobs", state="DECODING", lane="paid") == 7
    assert sample("darkroom_jobs", state="SCHEDULED", lane="paid") == 0
    assert sample("darkroom_jobs", state="RUNNING", lane="batch-lane") == 1
    # Ended jobs are counted as they end (darkroom_jobs_finished_total), not here.
    assert sample("darkroom_jobs", state="SUCCEEDED", lane="paid") is None
    assert sample("darkroom_queue_depth", lane="paid") == 3 and sample("darkroom_queue_depth", lane="unit-free") == 0
    assert sample("darkroom_queue_oldest_seconds", lane="paid") == 42
    show([], shown, now=now)
    assert sample("darkroom_jobs", state="QUEUED", lane="paid") == 0
    assert sample("darkroom_queue_oldest_seconds", lane="paid") == 0


async def test_the_gauge_loop_rides_out_a_database_outage() -> None:
    stop = asyncio.Event()
    now = datetime.now(UTC)

    class Jobs:
        calls = 0

        async def counts_by_lane(self) -> list[LaneCount]:
            self.calls += 1
            if self.calls == 1:
                raise StoreUnavailable("database unavailable")
            stop.set()
            return [LaneCount(JobStatus.QUEUED, "loop-lane", 2, now)]

    repo: Any = types.SimpleNamespace(jobs=Jobs())
    await asyncio.wait_for(job_gauges_loop(repo, ["loop-lane"], stop, every_s=0.01), 5)
    assert repo.jobs.calls == 2
    assert sample("darkroom_queue_depth", lane="loop-lane") == 2


def test_targets_are_a_file_service_discovery_file(tmp_path: Path) -> None:
    path = tmp_path / "prometheus" / "targets.json"
    write_targets(path, [Target("sampler-0", "sampler", "host-a", "127.0.0.1:9401")])
    assert json.loads(path.read_text()) == [
        {"targets": ["127.0.0.1:9401"], "labels": {"service": "sampler", "child": "sampler-0", "host": "host-a"}}
    ]
    assert path.stat().st_mode & 0o044 == 0o044  # a Prometheus running as its own user reads it
    write_targets(path, [])
    assert json.loads(path.read_text()) == []
    assert [p.name for p in path.parent.iterdir()] == ["targets.json"]


def test_children_get_consecutive_ports_from_a_first_one_or_free_ones(tmp_path: Path) -> None:
    fixed = MetricsPorts(9400)
    assert [fixed.next() for _ in range(3)] == [9400, 9401, 9402]
    free = MetricsPorts(0)
    ports = [free.next() for _ in range(20)]
    assert len(set(ports)) == 20 and all(p > 0 for p in ports)
    settings = Settings.from_env(env_of(data_dir=tmp_path, metrics_port=9400))
    c = child(settings, "decoder-1", "decoder", env_of(metrics_port=9405))
    target = metrics_target(c)
    assert target is not None and (target.service, target.child, target.address) == (
        "decoder",
        "decoder-1",
        "127.0.0.1:9405",
    )
    assert target.url == "http://127.0.0.1:9405/metrics"
    assert metrics_target(child(settings, "gateway", "gateway", env_of(metrics_port=0))) is None
    everywhere = metrics_target(child(settings, "gateway", "gateway", env_of(metrics_host="0.0.0.0")))
    assert everywhere is not None and everywhere.address == f"{socket.getfqdn()}:9400"


def test_the_metrics_port_setting() -> None:
    assert KernelSettings().metrics_port == 0  # a bare service serves none
    assert KernelSettings.from_env({"DARKROOM_METRICS_PORT": "9464"}).metrics_port == 9464
    with pytest.raises(ValueError, match="DARKROOM_METRICS_PORT"):
        KernelSettings.from_env({"DARKROOM_METRICS_PORT": "-1"})


def test_a_service_serves_its_metrics_and_survives_a_taken_port(caplog: pytest.LogCaptureFixture) -> None:
    assert serve_metrics(KernelSettings(metrics_port=0), "gateway") is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert serve_metrics(KernelSettings(metrics_port=port), "gateway") is None
    assert "cannot serve metrics" in caplog.text
    from services.ops.processes import free_port

    port = free_port()
    server = serve_metrics(KernelSettings(metrics_port=port), "gateway")
    assert server is not None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert 'darkroom_build_info{service="gateway"' in text
    assert "process_resident_memory_bytes" in text  # the default collectors stay
    assert "_created" not in text


def test_tenant_labels_name_the_first_tenants_and_fold_the_rest_into_other() -> None:
    labels = tenant_metrics.TenantLabels(2)
    assert [labels(t) for t in ("cats", "dogs", "owls", "cats", "owls")] == ["cats", "dogs", "other", "cats", "other"]
