"""A real Prometheus (the distribution's package) runs the shipped scrape config,
``infra/prometheus/prometheus.yml``, against a running stack: it finds every
process through the targets file the stack writes, scrapes each one, loads the
shipped rules, and has every service's metrics after a job has run."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from gpu_worker.metrics import STAGES
from services.ops.processes import free_port
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.telemetry.metrics import targets_path
from tests.helpers import stub, wait_for, wait_terminal
from tests.needs import require

pytestmark = pytest.mark.integration

INFRA = Path(__file__).resolve().parents[2] / "infra" / "prometheus"
DASHBOARD = INFRA.parent / "grafana" / "darkroom.json"
# What Grafana puts in place of the dashboard's variables.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$worker": ".*", "$model": ".*", "$lane": ".*"}
# `up` itself (the stack) serves its backends' restarts.
SERVICES = {"gateway", "scheduler", "sampler", "decoder", "up"}
SUBMIT = "/darkroom.v1.ImageGeneration/SubmitJob"
GET_JOB = "/darkroom.v1.ImageGeneration/GetJob"
DECODE = "/darkroom.internal.v1.VaeDecoder/Decode"

Series = list[tuple[dict[str, str], float]]


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    require("" if found else "no prometheus binary on PATH (Debian/Ubuntu: apt-get install prometheus)")
    assert found is not None
    return found


def api(url: str, path: str, **params: str) -> Any:
    with urllib.request.urlopen(f"{url}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=5) as reply:
        body = json.load(reply)
    assert body["status"] == "success", body
    return body["data"]


def query(url: str, promql: str) -> Series:
    return [(r["metric"], float(r["value"][1])) for r in api(url, "query", query=promql)["result"]]


def panel_queries() -> list[str]:
    exprs = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            exprs.append(expr)
    return exprs


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, ConnectionError):
        return False


def config_for_test(config_dir: Path) -> Path:
    """The shipped config, scraping every second, next to the stack's targets file
    with the shipped rules linked beside it: its relative paths resolve there,
    as they do for an operator who links it into the data directory."""
    config = yaml.safe_load((INFRA / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    for rules in config.get("rule_files", []):
        (config_dir / rules).symlink_to(INFRA / rules)
    path = config_dir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextmanager
def prometheus(binary: str, config: Path, tmp: Path) -> Iterator[str]:
    url = f"http://127.0.0.1:{free_port()}"
    with open(tmp / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'tsdb'}",
                f"--web.listen-address={url.removeprefix('http://')}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for(lambda: ready(url) or proc.poll() is not None, bool, timeout=60, what="prometheus to become ready")
        assert proc.poll() is None, (tmp / "prometheus.log").read_text()
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def eventually(url: str, promql: str, check: Callable[[Series], bool], *, timeout: float = 60) -> Series:
    return wait_for(lambda: query(url, promql), check, timeout=timeout, what=promql)


def at_least(n: float) -> Callable[[Series], bool]:
    """The series add up to ``n`` or more (none add up to 0)."""
    return lambda series: sum(v for _, v in series) >= n


def test_prometheus_scrapes_every_service(prometheus_binary: str, stack: LocalStack, tmp_path: Path) -> None:
    client = stub(stack)
    reply = client.SubmitJob(pb.SubmitJobRequest(model="tiny", prompt="a lighthouse", width=64, height=64, steps=2))
    assert wait_terminal(client, reply.job_id).status == pb.JOB_STATUS_SUCCEEDED
    with pytest.raises(grpc.RpcError) as err:
        client.GetJob(pb.GetJobRequest(job_id="00000000-0000-0000-0000-000000000000"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    workers = {w.worker_id: w for w in client.GetStats(pb.GetStatsRequest()).workers}

    targets = targets_path(stack.settings.kernel.data_dir)
    listed = json.loads(targets.read_text())
    assert {group["labels"]["service"] for group in listed} == SERVICES
    assert len(listed) == len(stack.services) + 1  # the children, and the stack itself

    with prometheus(prometheus_binary, config_for_test(targets.parent), tmp_path) as url:
        wait_for(
            lambda: api(url, "targets", state="active")["activeTargets"],
            lambda ts: len(ts) == len(listed) and all(t["health"] == "up" for t in ts),
            timeout=60,
            what="every target up",
        )
        assert {s["service"] for s, up in query(url, 'up{job="darkroom"}') if up == 1} == SERVICES

        # Every service: who it is, its gRPC calls, and the process collector's figures.
        for service in SERVICES:
            eventually(url, f'darkroom_build_info{{service="{service}"}}', lambda s: len(s) >= 1)
            eventually(url, f'process_resident_memory_bytes{{service="{service}"}}', at_least(1))
        eventually(url, f'darkroom_rpc_requests_total{{service="gateway",method="{SUBMIT}",code="OK"}}', at_least(1))
        eventually(
            url,
            f'darkroom_rpc_requests_total{{service="gateway",method="{GET_JOB}",code="NOT_FOUND"}}',
            at_least(1),
        )
        eventually(url, f'darkroom_rpc_duration_seconds_count{{service="gateway",method="{SUBMIT}"}}', bool)

        # The scheduler counts the jobs not yet ended in PostgreSQL: every lane is shown.
        states = eventually(url, 'darkroom_jobs{service="scheduler",lane="free"}', lambda s: len(s) == 4)
        assert {labels["state"] for labels, _ in states} == {"QUEUED", "SCHEDULED", "RUNNING", "DECODING"}
        lanes = eventually(url, 'darkroom_queue_depth{service="scheduler"}', lambda s: len(s) == 2)
        assert {labels["lane"] for labels, _ in lanes} == {"paid", "free"}

        # The job's life, counted where it happened: submitted, placed, batched, its
        # stages timed and its end counted.
        eventually(url, 'darkroom_submits_total{service="gateway",lane="free",result="accepted"}', at_least(1))
        eventually(url, 'darkroom_queue_wait_seconds_count{service="scheduler",lane="free"}', at_least(1))
        eventually(url, 'sum(darkroom_placements_total{service="scheduler"})', at_least(1))
        eventually(url, 'darkroom_batch_images_count{service="sampler",model="tiny"}', at_least(1))
        stages = eventually(url, 'darkroom_stage_seconds_count{service="sampler",model="tiny"}', lambda s: len(s) == 7)
        assert {labels["stage"] for labels, _ in stages} == set(STAGES)
        eventually(url, 'darkroom_jobs_finished_total{service="sampler",outcome="succeeded"}', at_least(1))
        eventually(url, 'darkroom_streams_open{service="gateway"}', lambda s: len(s) == 1)

        # Samplers and decoders: GPU telemetry as NVML gives it, or absent and said so.
        available = eventually(
            url, "darkroom_gpu_telemetry_available", lambda s: {x["worker"] for x, _ in s} == set(workers)
        )
        for labels, value in available:
            worker = workers[labels["worker"]]
            assert labels["service"] == worker.kind
            assert value == (1 if worker.telemetry_source == "nvml" else 0)
            temperature = query(url, f'darkroom_gpu_temperature_celsius{{worker="{labels["worker"]}"}}')
            assert len(temperature) == value  # no 0 C from a worker without NVML
        eventually(url, 'darkroom_worker_inflight{service="sampler"}', lambda s: len(s) == 1)
        eventually(url, 'sum(darkroom_decode_batch_images_count{service="decoder"})', at_least(1))
        eventually(url, 'darkroom_decoder_queued_images{service="decoder"}', lambda s: len(s) == 1)
        eventually(url, f'darkroom_rpc_requests_total{{service="decoder",method="{DECODE}",code="OK"}}', at_least(1))
        # What jobs cost the shared parts, per service: statements and messages.
        for service in ("gateway", "scheduler", "sampler"):
            eventually(url, f'darkroom_db_statements_total{{service="{service}"}}', at_least(1))
            for direction in ("in", "out"):
                messages = f'darkroom_bus_messages_total{{service="{service}",direction="{direction}"}}'
                eventually(url, messages, at_least(1))

        # Every panel of the dashboard asks this Prometheus something it understands.
        for expr in panel_queries():
            try:
                api(url, "query", query=expr)
            except urllib.error.HTTPError as exc:
                pytest.fail(f"the dashboard's {expr!r}: {exc.read().decode(errors='replace')}")

        # The shipped rules load and evaluate.
        groups = wait_for(
            lambda: api(url, "rules")["groups"],
            lambda gs: gs and all(r["health"] == "ok" for g in gs for r in g["rules"]),
            timeout=30,
            what="every rule evaluated",
        )
        assert {g["name"] for g in groups} == {"darkroom.recording", "darkroom.alerts"}
