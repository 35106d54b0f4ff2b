"""The NetworkPolicies admit exactly the flows the services make.

Kubernetes' admission rule, modelled here, applied to every Darkroom pod and to the
pods the NATS chart and CloudNativePG make (its instances, its PgBouncer, its jobs'),
from every source (each other, the operators, Prometheus, an impostor in another
namespace, the internet): the front doors take anyone, metrics come from the
monitoring namespace, the samplers and decoders reach PostgreSQL through the pooler
only, and nothing else gets in."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from tests.deploy.rendering import NAMESPACE, OVERLAYS, one, pods


@dataclass(frozen=True)
class Endpoint:
    """A pod that sends or receives: its labels, its namespace ("" for an address
    outside the cluster) and its ports by name."""

    name: str
    namespace: str
    labels: Mapping[str, str]
    ports: Mapping[str, int]


def namespace_labels(namespace: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": namespace}


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {
            "In": has and value in e.get("values", []),
            "NotIn": not has or value not in e.get("values", []),
            "Exists": has,
            "DoesNotExist": not has,
        }[e["operator"]]
        if not ok:
            return False
    return True


def peer_admits(peer: Mapping[str, Any], source: Endpoint, namespace: str) -> bool:
    if "ipBlock" in peer:
        return source.namespace == ""
    if source.namespace == "":
        return False
    in_namespace = (
        selects(peer["namespaceSelector"], namespace_labels(source.namespace))
        if "namespaceSelector" in peer
        else source.namespace == namespace
    )
    return in_namespace and selects(peer.get("podSelector", {}), source.labels)


def port_admits(ports: list[Mapping[str, Any]], port_name: str, port: int) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        wanted = p.get("port")
        if wanted is None or wanted in (port_name, port):
            return True
        if isinstance(wanted, int) and wanted <= port <= p.get("endPort", wanted):
            return True
    return False


def admits(policies: list[dict[str, Any]], source: Endpoint, dest: Endpoint, port_name: str) -> bool:
    """Kubernetes' rule: a pod no policy selects for ingress takes everything; one
    that some do takes what any of their rules admits."""
    port = dest.ports[port_name]
    selecting = [
        p
        for p in policies
        if p["metadata"].get("namespace", NAMESPACE) == dest.namespace
        and selects(p["spec"]["podSelector"], dest.labels)
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
    ]
    if not selecting:
        return True
    return any(
        (not rule.get("from") or any(peer_admits(peer, source, dest.namespace) for peer in rule["from"]))
        and port_admits(rule.get("ports", []), port_name, port)
        for p in selecting
        for rule in p["spec"].get("ingress", [])
    )


# The pods the NATS chart (release "nats") and CloudNativePG make, as they label
# and name them, and the ones outside.
NATS = Endpoint(
    "nats",
    NAMESPACE,
    {"app.kubernetes.io/name": "nats", "app.kubernetes.io/instance": "nats", "app.kubernetes.io/component": "nats"},
    {"nats": 4222, "cluster": 6222, "monitor": 8222, "prom-metrics": 7777},
)
POSTGRES = Endpoint(
    "postgres",
    NAMESPACE,
    {"cnpg.io/cluster": "darkroom-db", "cnpg.io/podRole": "instance", "role": "primary"},
    {"postgresql": 5432, "status": 8000, "metrics": 9187},
)
# The Pooler's PgBouncer pods, labelled as CloudNativePG 1.30 labels them
# (pkg/specs/pgbouncer/deployments.go): cnpg.io/cluster too, like the instances.
POOLER = Endpoint(
    "pooler",
    NAMESPACE,
    {
        "cnpg.io/poolerName": "darkroom-db-pooler",
        "cnpg.io/cluster": "darkroom-db",
        "cnpg.io/podRole": "pooler",
        "app.kubernetes.io/name": "postgresql",
        "app.kubernetes.io/instance": "darkroom-db",
        "app.kubernetes.io/component": "pooler",
        "app.kubernetes.io/managed-by": "cloudnative-pg",
    },
    {"pgbouncer": 5432, "metrics": 9127},
)
# A job's pod (here the one that clones a new standby from the primary): no podRole.
POSTGRES_JOB = Endpoint(
    "postgres-job",
    NAMESPACE,
    {"cnpg.io/cluster": "darkroom-db", "cnpg.io/jobRole": "join", "cnpg.io/instanceName": "darkroom-db-4"},
    {},
)
CNPG_OPERATOR = Endpoint("cnpg-operator", "cnpg-system", {"app.kubernetes.io/name": "cloudnative-pg"}, {})
PROMETHEUS = Endpoint("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}, {})
# Another namespace's pod wearing Darkroom's labels, and the internet.
IMPOSTOR = Endpoint(
    "impostor", "elsewhere", {"app.kubernetes.io/name": "darkroom", "app.kubernetes.io/component": "scheduler"}, {}
)
INTERNET = Endpoint("internet", "", {}, {})

OTHERS = (NATS, POSTGRES, POOLER, POSTGRES_JOB, CNPG_OPERATOR, PROMETHEUS, IMPOSTOR, INTERNET)

DARKROOM = ("gateway", "http", "scheduler", "sampler", "decoder")
# (from, to, port) beside the front doors, which take any source.
FRONT_DOORS = {("gateway", 50051), ("http", 8080)}
FLOWS = {
    ("scheduler", "sampler", 50061),
    ("gateway", "sampler", 50061),
    ("sampler", "decoder", 50071),
    *(("prometheus", service, 9100) for service in DARKROOM),
    *((service, "nats", 4222) for service in ("scheduler", "gateway", "sampler")),
    ("nats", "nats", 6222),
    ("prometheus", "nats", 7777),
    # The samplers and decoders through PgBouncer, the rest (and the migrations)
    # directly.
    *((service, "postgres", 5432) for service in ("gateway", "http", "scheduler")),
    *((service, "pooler", 5432) for service in ("sampler", "decoder")),
    ("pooler", "postgres", 5432),
    ("prometheus", "pooler", 9127),
    *((peer, "postgres", port) for peer in ("postgres", "postgres-job") for port in POSTGRES.ports.values()),
    ("cnpg-operator", "postgres", 8000),
    ("cnpg-operator", "postgres", 5432),
    ("prometheus", "postgres", 9187),
}


def darkroom_endpoints(docs: list[dict[str, Any]]) -> list[Endpoint]:
    return [
        Endpoint(
            pod.labels["app.kubernetes.io/component"],
            pod.namespace,
            pod.labels,
            {p["name"]: p["containerPort"] for c in pod.spec["containers"] for p in c.get("ports", [])},
        )
        for pod in pods(docs)
    ]


def admitted_flows(docs: list[dict[str, Any]]) -> set[tuple[str, str, int]]:
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    own = darkroom_endpoints(docs)
    sources = [*own, *OTHERS]
    return {
        (source.name, dest.name, port)
        for dest in [*own, NATS, POSTGRES, POOLER]
        for port_name, port in dest.ports.items()
        for source in sources
        if admits(policies, source, dest, port_name)
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_admit_the_services_flows_and_nothing_else(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    anyone = [e.name for e in [*darkroom_endpoints(docs), *OTHERS]]
    expected = FLOWS | {(source, dest, port) for dest, port in FRONT_DOORS for source in anyone}
    assert admitted_flows(docs) == expected


def test_a_policy_opened_to_everyone_is_caught(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = copy.deepcopy(rendered["fleet"])
    del one(docs, "NetworkPolicy", "darkroom-decoder-from-samplers")["spec"]["ingress"][0]["from"]
    assert ("internet", "decoder", 50071) in admitted_flows(docs)


def test_the_pooler_is_no_way_around_the_databases_policy(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """The instances' policy once selected every pod labelled cnpg.io/cluster and
    admitted any such pod on every port, and the pooler wears that label: selected
    so again, the pooler would reach the instances' every port, and the operator
    (and the pooler itself) the pooler's."""
    docs = copy.deepcopy(rendered["fleet"])
    instances = one(docs, "NetworkPolicy", "darkroom-db")["spec"]
    for selector in (instances["podSelector"], instances["ingress"][1]["from"][0]["podSelector"]):
        del selector["matchExpressions"]
    flows = admitted_flows(docs)
    assert {("pooler", "postgres", 8000), ("cnpg-operator", "pooler", 5432), ("pooler", "pooler", 5432)} <= flows
