from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import torch

from services.config.sections import Settings
from services.db.migrate import upgrade
from services.db.repository import Repository
from services.db.repository.database import libpq_url
from services.models.builtins import BUILTINS, ensure_builtin
from services.ops.embedded import EmbeddedPostgres
from services.ops.embedded_nats import EmbeddedNats
from services.ops.postgres_as_root import discard_clusters_of
from services.ops.stack import LocalStack
from tests.helpers import env_of

# The end-of-run report: time per directory and the fault scenarios' table.
pytest_plugins = ["tests.reporting"]

# The directories wholly in the quick tier (`pytest -m "not slow"`, docs/contributing.md);
# beside them, the stack modules marked `quick`. Every other test is marked slow.
QUICK_TIERS = ("tests/unit/", "tests/deploy/")


def pytest_configure(config: pytest.Config) -> None:
    # One torch thread per process: the suite runs several processes at once (the
    # xdist workers, the stacks' samplers and decoders, the benchmarks), and torch's
    # own pool in each, one thread per core, oversubscribes the cores and spins
    # (tests/unit: 94 s with it, 61 s without, on 2 cores under -n 3). A stack's
    # children get their share of the cores from the stack itself.
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that used the session's PostgreSQL carries the end of the
    server's log: a server that closed connections under it (seen once in CI, a
    backend gone mid-query) says why only there."""
    outcome: Any = yield
    report = outcome.get_result()
    if report.failed and _SESSION_POSTGRES and "postgres" in getattr(item, "fixturenames", ()):
        log = _SESSION_POSTGRES[0].pgdata / "server.log"
        try:
            tail = log.read_text(errors="replace").splitlines()[-40:]
        except OSError as exc:
            tail = [f"{log}: {exc}"]
        report.sections.append(("the session's PostgreSQL log (last 40 lines)", "\n".join(tail)))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test outside the quick tier is marked ``slow``. (Under pytest-xdist,
    ``--dist loadscope`` in pyproject.toml keeps a module's tests on one worker, one
    after another, so that its module-scoped stack or fleet starts once.)"""
    for item in items:
        path = item.nodeid.split("::")[0]
        if not path.startswith(QUICK_TIERS) and item.get_closest_marker("quick") is None:
            item.add_marker(pytest.mark.slow)


_db_names = itertools.count()
# The default registry's miniatures, built once per session.
MINIATURE_MODELS = {
    "tiny": "builtin:tiny",
    "tiny-wan": "builtin:tiny-wan",
    "tiny-wan22": "builtin:tiny-wan22",
    "tiny-upscaler": "builtin:tiny-upscaler",
    "tiny-sd3": "builtin:tiny-sd3",
    "tiny-flux": "builtin:tiny-flux",
    "tiny-flux-schnell": "builtin:tiny-flux-schnell",
    "tiny-flux-kontext": "builtin:tiny-flux-kontext",
    "tiny-qwen-image": "builtin:tiny-qwen-image",
    "tiny-z-image": "builtin:tiny-z-image",
    "tiny-qwen-image-edit": "builtin:tiny-qwen-image-edit",
}


@pytest.fixture(scope="session", autouse=True)
def _no_clusters_left(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """As root, a stack's PostgreSQL cluster lives outside its data directory: those
    of the session's temporary directories go with the session."""
    yield
    discard_clusters_of(tmp_path_factory.getbasetemp())


_SESSION_POSTGRES: list[EmbeddedPostgres] = []


@pytest.fixture(scope="session")
def postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPostgres]:
    pg = EmbeddedPostgres(tmp_path_factory.mktemp("pg"), durable=False)
    pg.start()
    _SESSION_POSTGRES.append(pg)
    yield pg
    _SESSION_POSTGRES.remove(pg)
    pg.stop()
    pg.discard()  # as root, the cluster lives outside the temporary directory


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A nats-server with JetStream of the test's own, on a free port."""
    server = EmbeddedNats(tmp_path / "nats")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """torch on one thread for a module: the miniatures' operations are so small that
    two threads spend their time waiting for each other (on a busy two-core machine a
    tiny Wan generation took 7 s with two, 1 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    models = tmp_path_factory.mktemp("models")
    for name, source in MINIATURE_MODELS.items():
        ensure_builtin(BUILTINS[source], models / name)
    return models


def fresh_database(pg: EmbeddedPostgres, *, template: str = "template1") -> str:
    """A new database on the shared server, a copy of ``template`` (empty by default)."""
    name = f"t{next(_db_names)}"
    with psycopg.connect(libpq_url(pg.url_of("postgres")), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return pg.url_of(name)


_MIGRATED_TEMPLATE = "darkroom_migrated"
_templates_made: set[str] = set()


def migrated_database(pg: EmbeddedPostgres) -> str:
    """A new database with the schema at head: a copy of one migrated once per server
    rather than migrated again (a stack's own upgrade then finds nothing to do)."""
    if pg.url not in _templates_made:
        with psycopg.connect(libpq_url(pg.url_of("postgres")), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{_MIGRATED_TEMPLATE}"')
            conn.execute(f'CREATE DATABASE "{_MIGRATED_TEMPLATE}"')
        upgrade(pg.url_of(_MIGRATED_TEMPLATE))
        _templates_made.add(pg.url)
    return fresh_database(pg, template=_MIGRATED_TEMPLATE)


@pytest.fixture
async def repo(postgres: EmbeddedPostgres) -> AsyncIterator[Repository]:
    """A repository on a fresh, migrated database."""
    url = migrated_database(postgres)
    r = Repository(url, pool_size=2)
    try:
        yield r
    finally:
        await r.close()


@pytest.fixture
async def replicas(postgres: EmbeddedPostgres) -> AsyncIterator[tuple[Repository, Repository]]:
    """Two repositories (two replicas' pools) on a fresh, migrated database."""
    url = migrated_database(postgres)
    first, second = Repository(url, pool_size=10), Repository(url, pool_size=10)
    try:
        yield first, second
    finally:
        await first.close()
        await second.close()


def make_stack(
    tmp: Path, pg: EmbeddedPostgres, models: Path, *, samplers: int = 1, http: bool = False, **values: Any
) -> LocalStack:
    """A stack in ``tmp`` on a fresh database, its settings changed by ``values``
    (see ``env_of``); ``http``: with the HTTP API on a free port."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "models").symlink_to(models, target_is_directory=True)
    base = env_of(data_dir=tmp, database_url=migrated_database(pg), gateway_port=0, http_port=0, log_level="INFO")
    settings = Settings.from_env({**base, **env_of(**values)})
    return LocalStack(settings, cpu_workers=samplers, durable=False, http=http)


def running(stack: LocalStack) -> Iterator[LocalStack]:
    """``stack`` started, for a fixture to ``yield from``; stopped after."""
    try:
        stack.start()
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, postgres: EmbeddedPostgres, models_dir: Path
) -> Iterator[LocalStack]:
    yield from running(make_stack(tmp_path_factory.mktemp("stack"), postgres, models_dir))


@pytest.fixture(scope="session")
def model_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real S3 server (seaweedfs's ``weed mini``) for the model store, with its
    bucket made: ``.env()`` points a client at it, ``.sent_bytes()`` counts what it served."""
    from services.ops.model_store import EmbeddedModelStore

    store = EmbeddedModelStore(tmp_path_factory.mktemp("model-store"))
    store.start()
    try:
        yield store
    finally:
        store.stop()
