"""Every Darkroom container serves metrics where Prometheus looks.

The scrape configuration in infra/k8s/monitoring keeps pods by their name label and
a port named "metrics"; every pod wears the label, and that port is the one
DARKROOM_METRICS_PORT says, listening on every address."""

from __future__ import annotations

from typing import Any

import yaml

from tests.deploy.environment import container_env
from tests.deploy.rendering import named, pods


def test_every_darkroom_container_serves_metrics_where_prometheus_looks(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    config = yaml.safe_load(named(rendered["monitoring"], "ConfigMap", "darkroom-prometheus")["data"]["prometheus.yml"])
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "darkroom"]
    kept = {tuple(r["source_labels"]): r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    assert kept[("__meta_kubernetes_pod_container_port_name",)] == "metrics"
    docs = rendered["fleet"]
    for pod in pods(docs):
        assert pod.labels["app.kubernetes.io/name"] == kept[("__meta_kubernetes_pod_label_app_kubernetes_io_name",)]
        (container,) = pod.spec["containers"]
        env, _ = container_env(container, pod, docs)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == int(env["DARKROOM_METRICS_PORT"]) and env["DARKROOM_METRICS_HOST"] == "0.0.0.0"
