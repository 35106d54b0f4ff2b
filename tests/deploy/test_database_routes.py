"""Who reaches PostgreSQL by which road, as each service reads its settings.

The samplers and decoders go through CloudNativePG's PgBouncer (the Pooler, in
transaction mode, in front of the primary) and are told so
(DARKROOM_DATABASE_POOLED, without which they would prepare statements a pooled
server connection loses); the gateway, the scheduler, the HTTP API and the
migrations go to the primary's Service directly. Both roads check the server's
certificate against CloudNativePG's CA by the name they dial, which the cluster's
server certificate (the one the pooler presents) carries. The pooler takes TLS
only, the darkroom role only, and keeps the server-side guards a pooled client does
not send. A sampler sent around the pooler, or not told it is pooled, is caught."""

from __future__ import annotations

import base64
import contextlib
import copy
import hashlib
import hmac
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from services.db.repository.database import IDLE_IN_TRANSACTION_MS, libpq_url
from services.mesh.pki import CertificateAuthority
from services.ops import SERVICE_MODULES
from services.ops.pgbouncer import PGBOUNCER_BIN, auth_file_line
from services.ops.processes import free_port, wait_for_port
from tests.deploy.environment import container_env, darkroom_containers, load_settings
from tests.deploy.rendering import NAMESPACE, OVERLAYS, named, one
from tests.deploy.sandbox import PodSandbox, secret_contents
from tests.needs import require

POOLED = ("sampler", "decoder")
CLUSTER = "darkroom-db"
POOLER = "darkroom-db-pooler"
DB_CA = "/etc/darkroom/db/ca.crt"


def pooler_of(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (pooler,) = [d for d in docs if d["kind"] == "Pooler"]
    return pooler


def check_database_routes(docs: list[dict[str, Any]]) -> None:
    pooler = pooler_of(docs)
    assert pooler["metadata"]["name"] == POOLER and pooler["spec"]["cluster"]["name"] == CLUSTER
    # CloudNativePG names the pooler's Service after it, and points it at the primary.
    assert pooler["spec"]["type"] == "rw"
    services = set()
    for pod, container, service in darkroom_containers(docs):
        env, own_names = container_env(container, pod, docs)
        kernel, _ = load_settings(service, env, own_names)
        url = urlsplit(kernel.database_url)
        query = parse_qs(url.query)
        where = f"{pod.name}/{container['name']}"
        assert (url.password, url.path) == (None, "/darkroom"), where
        assert query["sslmode"] == ["verify-full"] and query["sslrootcert"] == [DB_CA], where
        if service != "http":  # the read-only role's: test_front_doors.py
            assert url.username == "darkroom", where
            password = {v["name"]: v for v in container["env"]}["PGPASSWORD"]["valueFrom"]["secretKeyRef"]
            assert (password["name"], password["key"]) == (f"{CLUSTER}-app", "password"), where
        if service in POOLED:
            assert (url.hostname, url.port) == (POOLER, 5432), f"{where} goes around the pooler"
            assert kernel.database_pooled, f"{where} goes through the pooler without DARKROOM_DATABASE_POOLED"
        else:
            assert (url.hostname, url.port) == (f"{CLUSTER}-rw", 5432), f"{where} does not go to the primary"
            assert not kernel.database_pooled, where
        services.add(service)
    assert services == {*SERVICE_MODULES, "migrate"}
    # What a container does not set itself is the primary's: the migrations' road.
    shared = named(docs, "ConfigMap", "darkroom-settings")["data"]
    assert urlsplit(shared["DARKROOM_DATABASE_URL"]).hostname == f"{CLUSTER}-rw"
    assert "DARKROOM_DATABASE_POOLED" not in shared


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_samplers_and_decoders_go_through_the_pooler_and_the_rest_directly(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    check_database_routes(docs)
    routes = {
        service: urlsplit(load_settings(service, *container_env(container, pod, docs))[0].database_url).hostname
        for pod, container, service in darkroom_containers(docs)
    }
    assert routes == {
        "gateway": f"{CLUSTER}-rw",
        "http": f"{CLUSTER}-rw",
        "scheduler": f"{CLUSTER}-rw",
        "migrate": f"{CLUSTER}-rw",
        "sampler": POOLER,
        "decoder": POOLER,
    }


def sampler_env(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    sampler = one(docs, "StatefulSet", "darkroom-sampler")
    (container,) = sampler["spec"]["template"]["spec"]["containers"]
    env: list[dict[str, Any]] = container["env"]
    return env


def test_a_sampler_around_the_pooler_or_not_told_it_is_pooled_is_caught(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = copy.deepcopy(rendered["fleet"])
    env = sampler_env(docs)
    env[:] = [v for v in env if v["name"] != "DARKROOM_DATABASE_POOLED"]
    with pytest.raises(AssertionError, match="without DARKROOM_DATABASE_POOLED"):
        check_database_routes(docs)
    docs = copy.deepcopy(rendered["fleet"])
    env = sampler_env(docs)
    env[:] = [v for v in env if v["name"] != "DARKROOM_DATABASE_URL"]
    with pytest.raises(AssertionError, match="goes around the pooler"):
        check_database_routes(docs)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pooler_is_transaction_mode_tls_only_and_keeps_the_server_side_guards(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    spec = pooler_of(docs)["spec"]
    bouncer = spec["pgbouncer"]
    params = bouncer["parameters"]
    assert bouncer["poolMode"] == "transaction"
    # What a pooled client does not send as startup options (database.py), here:
    # a frozen client's transaction, and its advisory lock, ends as it would directly.
    assert float(params["idle_transaction_timeout"]) == IDLE_IN_TRANSACTION_MS / 1000
    assert params["tcp_keepalive"] == "1" and int(params["tcp_keepidle"]) <= 5
    # TLS from the clients (no plaintext login), and to the primary by its name.
    assert params["client_tls_sslmode"] == "require"
    assert params["server_tls_sslmode"] == "verify-full"
    # CloudNativePG's own certificates and auth_query: a Secret of ours would turn
    # them off (and the darkroom-db-app password with them).
    for own in ("clientTLSSecret", "clientCASecret", "serverTLSSecret", "serverCASecret", "authQuerySecret"):
        assert own not in bouncer
    # The darkroom role on its database over TLS; the rules after it refuse the rest
    # before CloudNativePG's own (any role, by password) are reached.
    rules = [rule.split() for rule in bouncer["pg_hba"]]
    admitted = [r for r in rules if r[-1] != "reject"]
    assert admitted and all(r[:3] == ["hostssl", "darkroom", "darkroom"] and r[-1] == "scram-sha-256" for r in admitted)
    assert rules[len(admitted) :] == [
        ["host", "all", "all", "0.0.0.0/0", "reject"],
        ["host", "all", "all", "::/0", "reject"],
    ]
    # The name the samplers dial is on the certificate the pooler presents.
    cluster = one(docs, "Cluster", CLUSTER)["spec"]
    assert POOLER in cluster["certificates"]["serverAltDNSNames"]
    assert "serverTLSSecret" not in cluster["certificates"]  # CloudNativePG issues it, with these names
    # PostgreSQL's connections from the pooler are bounded, well inside max_connections.
    server_connections = spec["instances"] * int(params["max_db_connections"])
    assert server_connections <= int(cluster["postgresql"]["parameters"]["max_connections"]) // 4
    assert spec["instances"] == (2 if overlay == "fleet" else 1)


def cnpg_server_certificate_names(cluster: dict[str, Any]) -> list[str]:
    """The names CloudNativePG 1.30 issues the cluster's server certificate for
    (GetClusterAltDNSNames, api/v1/cluster_funcs.go): its rw, r and ro Services as
    the namespace's pods may spell them, then spec.certificates.serverAltDNSNames."""
    names = []
    for service in (f"{CLUSTER}-rw", f"{CLUSTER}-r", f"{CLUSTER}-ro"):
        names += [
            service,
            f"{service}.{NAMESPACE}",
            f"{service}.{NAMESPACE}.svc",
            f"{service}.{NAMESPACE}.svc.cluster.local",
        ]
    return names + list(cluster["spec"].get("certificates", {}).get("serverAltDNSNames", []))


def scram_secret(password: str, iterations: int = 4096) -> str:
    """PostgreSQL's SCRAM-SHA-256 verifier for an ASCII password, as pg_shadow keeps it."""
    salt = os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    stored_key = hashlib.sha256(hmac.new(salted, b"Client Key", "sha256").digest()).digest()
    server_key = hmac.new(salted, b"Server Key", "sha256").digest()
    b64 = [base64.b64encode(b).decode() for b in (salt, stored_key, server_key)]
    return f"SCRAM-SHA-256${iterations}:{b64[0]}${b64[1]}:{b64[2]}"


@contextlib.contextmanager
def pgbouncer_as_cnpg_runs_it(pooler: dict[str, Any], cert: Path, key: Path, password: str) -> Iterator[int]:
    """Debian's PgBouncer configured as CloudNativePG configures the Pooler's
    (pkg/management/pgbouncer/config/config.go: its defaults, the Pooler's
    parameters, its forced settings, the Pooler's pg_hba before its own rules),
    with the cluster's certificate, and an auth_file standing in for the auth_query
    (what pg_shadow holds, a SCRAM secret, for the darkroom role and one other). No server behind it:
    a client it lets in waits for one, which query_wait_timeout cuts short. Yields
    its port."""
    directory = cert.parent
    bouncer = pooler["spec"]["pgbouncer"]
    port = free_port()
    params = {
        "log_stats": "0",
        "auth_type": "hba",
        "client_tls_sslmode": "prefer",
        "server_tls_sslmode": "verify-ca",
        **bouncer["parameters"],
        "ignore_startup_parameters": "extra_float_digits,options",
        "query_wait_timeout": "1",
        "listen_addr": "127.0.0.1",
        "listen_port": str(port),
        "unix_socket_dir": "",
        "auth_hba_file": str(directory / "pg_hba.conf"),
        "auth_file": str(directory / "userlist.txt"),
        "client_tls_cert_file": str(cert),
        "client_tls_key_file": str(key),
    }
    ini = ["[databases]", f"* = host=127.0.0.1 port={free_port()}", "[pgbouncer]", f"pool_mode = {bouncer['poolMode']}"]
    ini += [f"{k} = {v}" for k, v in sorted(params.items())]
    (directory / "pgbouncer.ini").write_text("\n".join(ini) + "\n")
    hba = ["local pgbouncer pgbouncer peer", *bouncer["pg_hba"], "host all all 0.0.0.0/0 md5", "host all all ::/0 md5"]
    (directory / "pg_hba.conf").write_text("\n".join(hba) + "\n")
    secret = scram_secret(password)
    (directory / "userlist.txt").write_text(
        auth_file_line("darkroom", secret) + auth_file_line("darkroom_files", secret)
    )
    args = [PGBOUNCER_BIN]
    if os.geteuid() == 0:
        # PgBouncer refuses root: it reads its files as root, then becomes nobody.
        args += ["-u", "nobody"]
    proc = subprocess.Popen([*args, str(directory / "pgbouncer.ini")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, timeout=10, proc=proc)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def connect_as_the_sampler(url: str, port: int, password: str, **override: str) -> str:
    """What connecting with the sampler's URL (its name resolved to 127.0.0.1)
    comes to: PgBouncer's or libpq's error message."""
    params = {**conninfo_to_dict(libpq_url(url)), "hostaddr": "127.0.0.1", "port": str(port)}
    params.update(password=password, connect_timeout="10", **override)
    try:
        psycopg.connect(make_conninfo("", **params)).close()
    except psycopg.OperationalError as exc:
        return str(exc)
    raise AssertionError("connected with no server behind the pooler")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_sampler_logs_into_the_pooler_over_verified_tls_and_nothing_else_does(
    rendered: dict[str, list[dict[str, Any]]], mesh: Path, tmp_path: Path, overlay: str
) -> None:
    """A real PgBouncer, configured from the Pooler as CloudNativePG does, serving
    a certificate issued for the names CloudNativePG gives the cluster's: the
    sampler's URL, with its CA file, logs in; a wrong password, another role,
    plaintext, and a name the certificate does not carry do not. Without the
    cluster's serverAltDNSNames the sampler's verify-full would refuse the pooler."""
    require("" if Path(PGBOUNCER_BIN).exists() else f"no pgbouncer at {PGBOUNCER_BIN} (apt-get install pgbouncer)")
    docs = rendered[overlay]
    pooler, cluster = pooler_of(docs), one(docs, "Cluster", CLUSTER)
    pod, container, _ = next(c for c in darkroom_containers(docs) if c[2] == "sampler")
    sandbox = PodSandbox(pod, secret_contents(docs, mesh), tmp_path / "pod")
    env, own_names = container_env(container, pod, docs)
    kernel, _ = load_settings("sampler", sandbox.env(env), own_names)
    # The sampler's sslrootcert is darkroom-db-ca's ca.crt (here the mesh CA's
    # stand-in, sandbox.py): the CA the cluster's server certificate is issued by.
    ca = CertificateAuthority.load(mesh)
    assert (sandbox.root / DB_CA.lstrip("/")).read_bytes() == (mesh / "ca.pem").read_bytes()
    password = "the-darkroom-db-app-password"

    served = tmp_path / "served"
    paths = ca.issue_into(served, "postgres", cnpg_server_certificate_names(cluster))
    with pgbouncer_as_cnpg_runs_it(pooler, paths.cert, paths.key, password) as port:
        url = kernel.database_url.replace(DB_CA, str(sandbox.root / DB_CA.lstrip("/")))
        assert "query_wait_timeout" in connect_as_the_sampler(url, port, password)  # in, waiting for a server
        assert "SASL authentication failed" in connect_as_the_sampler(url, port, "wrong")
        assert "login rejected" in connect_as_the_sampler(url, port, password, user="darkroom_files")
        assert "SSL required" in connect_as_the_sampler(url, port, password, sslmode="disable")
        assert "does not match host name" in connect_as_the_sampler(url, port, password, host="darkroom-db-elsewhere")

    # The certificate CloudNativePG would issue without serverAltDNSNames.
    unnamed = copy.deepcopy(cluster)
    del unnamed["spec"]["certificates"]
    bare = tmp_path / "bare"
    paths = ca.issue_into(bare, "postgres", cnpg_server_certificate_names(unnamed))
    with pgbouncer_as_cnpg_runs_it(pooler, paths.cert, paths.key, password) as port:
        assert "does not match host name" in connect_as_the_sampler(url, port, password)
