"""What the local stack (``services.ops.stack``) runs beneath its services, on its
data directory: the fleet's certificates and passwords (made once), PostgreSQL with
its migrations applied, nats-server and the model store (each embedded unless
settings name one elsewhere), and the check that an open gateway would be let start.

The stack holds its data directory's lock while it runs (``data_lock``): backends
found running on it were left by an ``up`` that died, and are stopped cleanly
before its own start (``orphans``). Its own backends are supervised like its
children (``backends``)."""

from __future__ import annotations

from pathlib import Path

from services.config.fields import SettingsError
from services.config.sections import Settings
from services.mesh.secrets import ensure_certificates, password
from services.ops.backends import BackendMetrics, SupervisedBackend
from services.ops.children import fork_servers, restart_policy
from services.ops.data_lock import DataDirLock
from services.ops.embedded import EmbeddedPostgres
from services.ops.embedded_nats import EmbeddedNats
from services.ops.model_store import EmbeddedModelStore
from services.ops.orphans import stop_nats_servers
from services.ops.store_identities import (
    GATEWAY_SECRET_FILE,
    READER_SECRET_FILE,
    SAMPLER_SECRET_FILE,
    WRITER_SECRET_FILE,
    StoreIdentities,
    StoreIdentity,
)
from services.ops.supervisor import Supervisor


class StackBackends:
    """The backends of a stack on ``settings``' data directory, and the supervisor
    that watches them (and runs the stack's services)."""

    def __init__(self, settings: Settings, *, durable: bool = True, model_store: bool = False) -> None:
        self.settings = settings
        self.durable = durable
        self.postgres: EmbeddedPostgres | None = None
        self.nats: EmbeddedNats | None = None
        # `up --model-store`: a local S3 server for `store:` models, unless DARKROOM_MODEL_STORE_URL names one.
        self.start_model_store = model_store
        self.model_store: EmbeddedModelStore | None = None
        self.supervisor = Supervisor(restart_policy(settings), forks=fork_servers(settings))
        self.lock = DataDirLock(settings.kernel.data_dir)
        # The stack's own metrics (its backends' restarts), served by `up` itself.
        self.backend_metrics = BackendMetrics()

    @property
    def pg_url(self) -> str:
        """The database URL for psycopg (no SQLAlchemy driver suffix)."""
        return self.settings.kernel.database_url.replace("postgresql+psycopg://", "postgresql://")

    def start_backends(self) -> None:
        data = self.settings.kernel.data_dir
        data.mkdir(parents=True, exist_ok=True)
        self.lock.acquire()
        if not self.settings.kernel.mesh_dir:
            # Sealed by default: the CA, a certificate per role, and passwords, made once.
            ensure_certificates(data / "secrets")
            self.settings = self.settings.with_env({"DARKROOM_MESH_DIR": str(data / "secrets")})
        if not self.settings.kernel.database_url:
            self.postgres = EmbeddedPostgres(data, durable=self.durable, mesh_dir=Path(self.settings.kernel.mesh_dir))
            self.postgres.start(take_over=True)  # the lock is ours: a server on its data is an orphan
            self.settings = self.settings.with_env({"DARKROOM_DATABASE_URL": self.postgres.url})
        if not self.settings.kernel.nats_url:
            self.nats = EmbeddedNats(data, mesh_dir=Path(self.settings.kernel.mesh_dir))
            stop_nats_servers(self.nats.config_path)  # orphans on its store, as above
            self.nats.start()
            self.settings = self.settings.with_env({"DARKROOM_NATS_URL": self.nats.url})
        if self.start_model_store and not self.settings.kernel.model_store.model_store_url:
            secrets = Path(self.settings.kernel.mesh_dir)
            # Made once, kept with the others: the writer's for the operator's
            # `darkroom models`, the others each for its role's services.
            identities = StoreIdentities(
                *(
                    StoreIdentity(f"darkroom-{role}", password(secrets / secret))
                    for role, secret in (
                        ("writer", WRITER_SECRET_FILE),
                        ("sampler", SAMPLER_SECRET_FILE),
                        ("reader", READER_SECRET_FILE),
                        ("gateway", GATEWAY_SECRET_FILE),
                    )
                )
            )
            self.model_store = EmbeddedModelStore(
                data / "model-store",
                bucket=self.settings.kernel.model_store.model_store_bucket,
                identities=identities,
            )
            self.model_store.start()
            self.settings = self.settings.with_env(self.model_store.stack_env())
        for name, backend in (("postgres", self.postgres), ("nats", self.nats), ("model-store", self.model_store)):
            if backend is not None:
                self.supervisor.watch(SupervisedBackend(name, backend, self.backend_metrics))
        from services.db.migrate import upgrade

        upgrade(self.settings.kernel.database_url)

    def check_open_access(self) -> None:
        """Raises SettingsError, naming the fix, where the gateway would refuse to
        start: open (no tenants, no keys) with a listener off the loopback
        (``services.open_access``). Said here, before any child starts, rather than
        by a gateway its supervisor restarts."""
        from services.open_access import anonymous_allowed, refusal

        gateway, http = self.settings.gateway, self.settings.http
        if gateway.api_keys or anonymous_allowed(gateway, http):
            return
        import psycopg

        with psycopg.connect(self.pg_url, connect_timeout=5) as conn:
            row = conn.execute("SELECT EXISTS (SELECT 1 FROM tenants)").fetchone()
        why = refusal(gateway, http, tenants_exist=bool(row and row[0]))
        if why:
            raise SettingsError(why)

    def stop_backends(self) -> None:
        """Stops the backends it started and lets the data directory go; its
        services are stopped first."""
        self.backend_metrics.close()
        if self.nats is not None:
            self.nats.stop()
        if self.model_store is not None:
            self.model_store.stop()
        if self.postgres is not None:
            self.postgres.stop()
        self.lock.release()
