"""Every resource validates against the schemas the cluster applies.

Rendered or listed in a kustomization, each resource validates against the Kubernetes
schemas (kubernetes-validate, strict: an unknown field is an error) of the oldest and
the newest version supported; CloudNativePG's Cluster against its CRD's schema,
vendored in infra/k8s/schemas. A misspelt field is refused, so that the check is
known to bite."""

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
CNPG_SCHEMA = K8S / "schemas" / "cnpg-cluster-v1.30.0.json"


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


@pytest.fixture(scope="module")
def cnpg_cluster_validator() -> jsonschema.protocols.Validator:
    vendored = json.loads(CNPG_SCHEMA.read_text())
    return jsonschema.Draft202012Validator(strict_crd_schema(vendored["openAPIV3Schema"]))


def validate(doc: dict[str, Any], cnpg: jsonschema.protocols.Validator) -> None:
    if doc["apiVersion"] == "postgresql.cnpg.io/v1" and doc["kind"] == "Cluster":
        cnpg.validate(doc)
        return
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=True)


def test_every_rendered_resource_validates(
    rendered: dict[str, list[dict[str, Any]]], cnpg_cluster_validator: jsonschema.protocols.Validator
) -> None:
    for docs in rendered.values():
        for doc in docs:
            validate(doc, cnpg_cluster_validator)


def test_every_file_a_kustomization_lists_validates(
    tree: Path, cnpg_cluster_validator: jsonschema.protocols.Validator
) -> None:
    listed = [
        directory / entry
        for directory, kustomization in kustomizations(tree)
        for entry in kustomization.get("resources", [])
        if (directory / entry).is_file()
    ]
    assert len(listed) >= 9
    for path in listed:
        for doc in yaml.safe_load_all(path.read_text()):
            validate(doc, cnpg_cluster_validator)


def test_the_validators_refuse_a_misspelt_field(
    rendered: dict[str, list[dict[str, Any]]], cnpg_cluster_validator: jsonschema.protocols.Validator
) -> None:
    cluster = copy.deepcopy(one(rendered["fleet"], "Cluster", "darkroom-db"))
    cluster["spec"]["postgresql"]["synchronous"]["numbr"] = 1
    with pytest.raises(jsonschema.ValidationError, match="numbr"):
        validate(cluster, cnpg_cluster_validator)
    sampler = copy.deepcopy(one(rendered["fleet"], "StatefulSet", "darkroom-sampler"))
    sampler["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["failureTreshold"] = 3
    with pytest.raises(kubernetes_validate.ValidationError, match="failureTreshold"):
        validate(sampler, cnpg_cluster_validator)
