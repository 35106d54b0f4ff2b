"""Every resource validates against the schemas the cluster applies.

Rendered or listed in a kustomization, each resource validates against the Kubernetes
schemas (kubernetes-validate, strict: an unknown field is an error) of the oldest and
the newest version supported; CloudNativePG's Cluster and Pooler against their
CRDs' schemas, vendored in infra/k8s/schemas, and the Pooler's PgBouncer parameters
against those CloudNativePG lets through. A misspelt field is refused, so that the
check is known to bite."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.rendering import K8S, kustomizations, one

# The oldest Kubernetes the manifests are written for (gRPC probes, matchLabelKeys)
# and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.latest_version())
CNPG_VERSION = "v1.30.0"
CNPG_KINDS = ("Cluster", "Pooler")
# The PgBouncer parameters CloudNativePG's admission webhook accepts in a Pooler
# (AllowedPgbouncerGenericConfigurationParameters, internal/webhook/v1/pooler_webhook.go
# at the tag above); the rest it sets itself or refuses.
CNPG_PGBOUNCER_PARAMETERS = frozenset(
    """
    application_name_add_host auth_type autodb_idle_timeout cancel_wait_timeout client_idle_timeout
    client_login_timeout client_tls_ciphers client_tls_sslmode client_tls13_ciphers default_pool_size
    disable_pqexec dns_max_ttl dns_nxdomain_ttl idle_transaction_timeout ignore_startup_parameters
    listen_backlog log_connections log_disconnections log_pooler_errors log_stats max_client_conn
    max_db_connections max_packet_size max_prepared_statements max_user_connections min_pool_size pkt_buf
    query_timeout query_wait_timeout reserve_pool_size reserve_pool_timeout sbuf_loopcnt server_check_delay
    server_check_query server_connect_timeout server_fast_close server_idle_timeout server_lifetime
    server_login_retry server_reset_query server_reset_query_always server_round_robin server_tls_ciphers
    server_tls13_ciphers server_tls_protocols server_tls_sslmode stats_period suspend_timeout
    tcp_defer_accept tcp_socket_buffer tcp_keepalive tcp_keepcnt tcp_keepidle tcp_keepintvl
    tcp_user_timeout track_extra_parameters verbose
    """.split()
)


def cnpg_schema(kind: str) -> Path:
    return K8S / "schemas" / f"cnpg-{kind.lower()}-{CNPG_VERSION}.json"


def strict_crd_schema(node: Any) -> Any:
    """A CRD's structural schema as `kubectl --validate=strict` applies it: an object
    with listed properties takes no others."""
    if isinstance(node, list):
        return [strict_crd_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    strict = {key: strict_crd_schema(value) for key, value in node.items()}
    if "properties" in node and "additionalProperties" not in node:
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            strict["additionalProperties"] = False
    return strict


CnpgValidators = dict[str, jsonschema.protocols.Validator]


@pytest.fixture(scope="module")
def cnpg_validators() -> CnpgValidators:
    found = {}
    for kind in CNPG_KINDS:
        vendored = json.loads(cnpg_schema(kind).read_text())
        assert (vendored["group"], vendored["version"], vendored["kind"]) == ("postgresql.cnpg.io", "v1", kind)
        found[kind] = jsonschema.Draft202012Validator(strict_crd_schema(vendored["openAPIV3Schema"]))
    return found


def validate(doc: dict[str, Any], cnpg: CnpgValidators) -> None:
    if doc["apiVersion"] == "postgresql.cnpg.io/v1":
        assert doc["kind"] in cnpg, f"no schema vendored for CloudNativePG's {doc['kind']}"
        cnpg[doc["kind"]].validate(doc)
        if doc["kind"] == "Pooler":
            refused = set(doc["spec"].get("pgbouncer", {}).get("parameters", {})) - CNPG_PGBOUNCER_PARAMETERS
            assert not refused, f"{doc['metadata']['name']}: CloudNativePG refuses the parameters {sorted(refused)}"
        return
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def test_every_rendered_resource_validates(
    rendered: dict[str, list[dict[str, Any]]], cnpg_validators: CnpgValidators
) -> None:
    for docs in rendered.values():
        for doc in docs:
            validate(doc, cnpg_validators)


def test_every_file_a_kustomization_lists_validates(tree: Path, cnpg_validators: CnpgValidators) -> None:
    listed = [
        directory / entry
        for directory, kustomization in kustomizations(tree)
        for entry in kustomization.get("resources", [])
        if (directory / entry).is_file()
    ]
    assert len(listed) >= 9
    for path in listed:
        for doc in yaml.safe_load_all(path.read_text()):
            validate(doc, cnpg_validators)


def test_the_validators_refuse_a_misspelt_field(
    rendered: dict[str, list[dict[str, Any]]], cnpg_validators: CnpgValidators
) -> None:
    cluster = copy.deepcopy(one(rendered["fleet"], "Cluster", "darkroom-db"))
    cluster["spec"]["postgresql"]["synchronous"]["numbr"] = 1
    with pytest.raises(jsonschema.ValidationError, match="numbr"):
        validate(cluster, cnpg_validators)
    sampler = copy.deepcopy(one(rendered["fleet"], "StatefulSet", "darkroom-sampler"))
    sampler["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["failureTreshold"] = 3
    with pytest.raises(kubernetes_validate.ValidationError, match="failureTreshold"):
        validate(sampler, cnpg_validators)
    pooler = copy.deepcopy(one(rendered["fleet"], "Pooler", "darkroom-db-pooler"))
    pooler["spec"]["pgbouncer"]["poolmode"] = pooler["spec"]["pgbouncer"].pop("poolMode")
    with pytest.raises(jsonschema.ValidationError, match="poolmode"):
        validate(pooler, cnpg_validators)
    pooler = copy.deepcopy(one(rendered["fleet"], "Pooler", "darkroom-db-pooler"))
    pooler["spec"]["pgbouncer"]["poolMode"] = "statement"
    with pytest.raises(jsonschema.ValidationError, match="statement"):
        validate(pooler, cnpg_validators)
    # A parameter CloudNativePG sets itself (and its admission webhook refuses).
    pooler = copy.deepcopy(one(rendered["fleet"], "Pooler", "darkroom-db-pooler"))
    pooler["spec"]["pgbouncer"]["parameters"]["listen_port"] = "6432"
    with pytest.raises(AssertionError, match="listen_port"):
        validate(pooler, cnpg_validators)
