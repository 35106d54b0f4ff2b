"""The HTTP tier's read-only database role, as the Kubernetes manifests make it: the
role CloudNativePG creates (postgres.yaml's postInitApplicationSQL, then a login and
password as its managed role gives), granted by the migrations what the HTTP API
reads. Through it the HTTP API serves a signed link to a result; it can write
nothing, and read neither tenants, keys nor input images."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from urllib.parse import urlencode

import grpc
import psycopg
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer
from psycopg import sql

from http_api.gateway_client import Gateway
from http_api.service import create_app
from http_api.signed_urls import UrlSigner
from services.config.http import HttpSettings
from services.db.migrate import upgrade
from services.db.repository import Repository
from services.db.repository.database import libpq_url
from services.ops.embedded import EmbeddedPostgres
from tests.conftest import fresh_database
from tests.deploy.rendering import K8S
from tests.records import new_job

pytestmark = [pytest.mark.integration, pytest.mark.quick]

ROLE, PASSWORD = "darkroom_files", "files-secret"
PNG = b"\x89PNG\r\n\x1a\n" + b"an image" * 8


def as_cloudnativepg_makes_it(superuser_url: str) -> None:
    """postgres.yaml's bootstrap SQL, then the managed role's login and password."""
    cluster = yaml.safe_load((K8S / "base" / "postgres.yaml").read_text())
    with psycopg.connect(libpq_url(superuser_url), autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (ROLE,)).fetchone()
        if not exists:  # roles are the server's: an earlier test of this session may have made it
            for statement in cluster["spec"]["bootstrap"]["initdb"]["postInitApplicationSQL"]:
                conn.execute(statement)
        conn.execute(sql.SQL("ALTER ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(ROLE), sql.Literal(PASSWORD)))


def url_as_role(pg: EmbeddedPostgres, database: str) -> str:
    query = urlencode({"host": pg.socket_dir, "port": pg.port, "user": ROLE, "password": PASSWORD})
    return f"postgresql+psycopg:///{database}?{query}"


async def test_the_http_api_serves_a_result_as_the_read_only_role_which_may_do_nothing_else(
    postgres: EmbeddedPostgres,
) -> None:
    owner_url = fresh_database(postgres)
    database = owner_url.split("?")[0].rsplit("/", 1)[1]
    as_cloudnativepg_makes_it(owner_url)
    upgrade(owner_url)
    owner = Repository(owner_url)
    try:
        await owner.jobs.create(new_job(id="job-files"), now=datetime.now(UTC))
    finally:
        await owner.close()
    with psycopg.connect(libpq_url(owner_url), autocommit=True) as conn:
        conn.execute(
            'INSERT INTO job_images (job_id, "index", data, mime_type, width, height, seed) '
            "VALUES ('job-files', 0, %s, 'image/png', 64, 64, 7)",
            (PNG,),
        )

    files_url = url_as_role(postgres, database)
    repo = Repository(files_url, pool_size=2)
    signer = UrlSigner(b"k" * 32, ttl_s=60)
    gateway = Gateway(grpc.aio.insecure_channel("127.0.0.1:9"))  # not called for /v1/files
    client = TestClient(TestServer(create_app(HttpSettings(), gateway, signer, repo)))
    await client.start_server()
    try:
        served = await client.get(signer.path("job-files", 0, time.time()))
        assert served.status == 200 and await served.read() == PNG
        missing = await client.get(signer.path("job-none", 0, time.time()))
        assert missing.status == 404
    finally:
        await client.close()
        await gateway.close()
        await repo.close()

    with psycopg.connect(libpq_url(files_url), autocommit=True) as conn:
        assert conn.execute("SELECT current_user").fetchone() == (ROLE,)
        for refused in (
            "UPDATE jobs SET status = status",
            "DELETE FROM job_images",
            'INSERT INTO job_images (job_id, "index", data, mime_type, width, height, seed) '
            "VALUES ('job-files', 1, '\\x00', 'image/png', 1, 1, 1)",
            "SELECT * FROM tenants",
            "SELECT * FROM api_keys",
            "SELECT * FROM job_inputs",
            "SELECT * FROM admin_actions",
            "CREATE TABLE planted (x int)",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(refused)
