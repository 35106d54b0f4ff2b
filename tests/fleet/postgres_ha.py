"""A highly available PostgreSQL on the fleet's hosts: pg_auto_failover (Debian's
``pg-auto-failover-cli`` and ``postgresql-15-auto-failover``) with a monitor on
one host and two data nodes on two others, synchronous replication between them,
TLS with certificates of the fleet's CA and scram-sha-256 passwords everywhere.

Why pg_auto_failover rather than Patroni: it needs nothing but PostgreSQL (its
monitor is a PostgreSQL with an extension), where Patroni needs a consensus store
(etcd, Consul or ZooKeeper) run and secured beside it; its two-node formation
replicates synchronously by default and never promotes a standby that was not in
sync; and a primary cut off from both the monitor and its standby demotes itself
(``network_partition_timeout``) before the monitor promotes the standby
(``primary_demote_timeout``), so two primaries never take writes at once. (Its
keeper, on two loaded cores, can miss its turn: the failover scenario records whether
the cut primary had stopped at the promotion rather than require it.)

Services reach the writable node through one libpq URL naming both data nodes
with ``target_session_attrs=read-write``."""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from services.mesh.pki import CertificateAuthority, write_private
from services.mesh.secrets import password
from tests.fleet.network import Host

PG_BIN = Path("/usr/lib/postgresql/15/bin")
PG_AUTOCTL = "/usr/bin/pg_autoctl"
PORT = 5432
# What psql says while a server is stopping or starting: the statement never ran,
# or was cut off as the server stopped (the statements sent again are idempotent).
_RESTARTING = (
    "the database system is shutting down",
    "the database system is starting up",
    "terminating connection due to administrator command",
    "server closed the connection unexpectedly",  # stopped while the connection began
    "Connection refused",
    "No such file or directory",  # its socket, while it is stopped
)
DATABASE = "darkroom"
APP_USER = "darkroom"
SYSTEM_USER = "postgres"  # PostgreSQL refuses to run as root

# Failover in seconds rather than the defaults' minute. The order matters. A
# primary cut off demotes itself once it has had neither the monitor nor a standby
# for network_partition_timeout (pg_autoctl's default, 20 s: version 2.0 reads it
# only as it starts, and a `config set` on a running keeper changes nothing). It
# counts from the last time it saw its standby after losing the monitor, and sees
# the standby gone only when its replication connection times out
# (wal_sender_timeout); a keeper that never saw the standby then, the connection
# gone before its first check of the partition, never demotes itself at all (twice
# on 2026-11-27 with 3 s, the first check 4 s after the cut; once on 2026-11-28 with
# 8 s, the fleet beside two other test workers on two cores): 16 s outlasts that
# check, and the old primary stops about 16 + 20 s after the cut. The monitor
# promotes the standby only primary_demote_timeout after it found the primary
# unhealthy: longer than both with room for the keeper's loop, whose calls to a
# monitor it cannot reach time out one by one, so that two primaries never serve
# at once (30 s left 3 s to spare on 2026-11-27; with 12 s and 45 s the old primary
# still served at the promotion in two clean-clone runs of the whole suite on
# 2026-11-28, whose other workers load the two cores; 16 s and 60 s leave about 24).
REPLICATION_TIMEOUT = "16s"
MONITOR_SETTINGS = {
    "pgautofailover.health_check_period": "1000",
    "pgautofailover.health_check_timeout": "1000",
    "pgautofailover.health_check_max_retries": "1",
    "pgautofailover.health_check_retry_delay": "500",
    "pgautofailover.node_considered_unhealthy_timeout": "3000",
    "pgautofailover.primary_demote_timeout": "60000",
    "pgautofailover.startup_grace_period": "2000",
}


def unavailable_reason() -> str:
    if not Path(PG_AUTOCTL).exists() or not (PG_BIN / "pg_ctl").exists():
        return "pg_auto_failover is not installed (Debian: pg-auto-failover-cli, postgresql-15-auto-failover)"
    try:
        import pwd

        pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        return f"no {SYSTEM_USER} user (Debian's postgresql package makes it)"
    return ""


def _as_postgres(args: list[str]) -> list[str]:
    return ["setpriv", f"--reuid={SYSTEM_USER}", f"--regid={SYSTEM_USER}", "--init-groups", "--", *args]


@dataclass
class Node:
    """One pg_autoctl-managed PostgreSQL (the monitor or a data node) on a host."""

    host: Host
    root: Path  # owned by the postgres user

    @property
    def pgdata(self) -> Path:
        return self.root / "pgdata"

    @property
    def sockets(self) -> Path:
        return self.root / "run"

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "PATH": f"{PG_BIN}:/usr/bin:/bin:/usr/sbin:/sbin",
            "HOME": str(self.root),
            "XDG_CONFIG_HOME": str(self.root / "config"),
            "XDG_DATA_HOME": str(self.root / "share"),
            # Every host shares this machine's file system: each server's unix
            # socket in a directory of its own, not /var/run/postgresql.
            "PG_REGRESS_SOCK_DIR": str(self.sockets),
            "PGHOST": str(self.sockets),
            "PGDATA": str(self.pgdata),
            # initdb takes its encoding from the locale: UTF-8, not SQL_ASCII's bytes.
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            **extra,
        }

    def autoctl(self, *args: str, **env: str) -> str:
        return self.host.run(_as_postgres([PG_AUTOCTL, *args]), env=self.env(**env), timeout=120)

    def serves_as_primary(self) -> bool:
        """Whether its PostgreSQL is up and out of recovery, asked on its own socket
        (which no cut of its network reaches)."""
        try:
            return self.sql("SELECT pg_is_in_recovery()").strip() == "f"
        except RuntimeError:  # stopped: it demoted itself
            return False

    def sql(self, statement: str, database: str = "postgres") -> str:
        """A statement run as the superuser on the local socket."""
        return self.host.run(
            _as_postgres([str(PG_BIN / "psql"), "-X", "-At", "-p", str(PORT), "-d", database, "-c", statement]),
            env=self.env(),
        )

    def sql_once_up(self, statement: str, *, timeout: float = 60) -> str:
        """``sql``, waiting out a restart of the server: pg_autoctl restarts a new
        node's PostgreSQL as it applies its settings, and a statement sent meanwhile
        meets "the database system is shutting down" (it never ran: it is sent again),
        or is cut off by the stop (it may have run: every statement sent so is
        idempotent)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.sql(statement)
            except RuntimeError as exc:
                if time.monotonic() > deadline or not any(s in str(exc) for s in _RESTARTING):
                    raise
            time.sleep(0.2)


class PostgresHA:
    """The monitor on ``monitor``, data nodes on ``nodes`` (the first starts as
    primary), files under ``root``, certificates from ``ca``."""

    def __init__(self, root: Path, ca: CertificateAuthority, monitor: Host, nodes: list[Host]) -> None:
        self.root = root
        self.ca = ca
        self.secrets = root / "secrets"
        self.monitor = Node(monitor, root / monitor.name)
        self.nodes = [Node(h, root / h.name) for h in nodes]
        self.app_password = password(self.secrets / "darkroom.password")
        self._monitor_password = password(self.secrets / "autoctl_node.password")
        self._replication_password = password(self.secrets / "replication.password")

    @property
    def monitor_url(self) -> str:
        tls = f"sslmode=verify-full&sslrootcert={self.secrets / 'ca.pem'}"
        return f"postgres://autoctl_node:{self._monitor_password}@{self.monitor.host.address}:{PORT}/pg_auto_failover?{tls}"

    def database_url(self, passfile: Path, ca_file: Path) -> str:
        """What every service is given: both data nodes, the writable one chosen,
        over TLS that checks the server's name, with the password from a file."""
        hosts = ",".join(n.host.address for n in self.nodes)
        ports = ",".join(str(PORT) for _ in self.nodes)
        return (
            f"postgresql+psycopg://{APP_USER}@/{DATABASE}?host={hosts}&port={ports}"
            f"&target_session_attrs=read-write&sslmode=verify-full&sslrootcert={ca_file}&passfile={passfile}"
        )

    def write_pgpass(self, path: Path) -> Path:
        write_private(path, f"*:*:{DATABASE}:{APP_USER}:{self.app_password}\n".encode())
        return path

    def _prepare(self, node: Node) -> list[str]:
        """The node's directories and TLS files, owned by the postgres user; the
        pg_autoctl options that point at them."""
        import pwd

        user = pwd.getpwnam(SYSTEM_USER)
        for sub in ("run", "config", "share", "tls"):
            (node.root / sub).mkdir(parents=True, exist_ok=True)
        paths = self.ca.issue_into(node.root / "tls", "postgres", [node.host.address, node.host.name])
        shutil.copy(paths.ca, self.secrets / "ca.pem")
        for path in [node.root, *node.root.rglob("*")]:
            os.chown(path, user.pw_uid, user.pw_gid)
        self.secrets.chmod(0o755)
        (self.secrets / "ca.pem").chmod(0o644)
        return [
            "--pgctl", str(PG_BIN / "pg_ctl"),
            "--pgdata", str(node.pgdata),
            "--pgport", str(PORT),
            "--hostname", node.host.address,
            "--auth", "scram-sha-256",
            "--ssl-ca-file", str(paths.ca),
            "--server-cert", str(paths.cert),
            "--server-key", str(paths.key),
            "--ssl-mode", "verify-full",
        ]  # fmt: skip

    def start(self) -> None:
        self.secrets.mkdir(parents=True, exist_ok=True)
        options = self._prepare(self.monitor)
        proc = self.monitor.host.spawn(
            _as_postgres([PG_AUTOCTL, "create", "monitor", *options, "--run"]),
            env=self.monitor.env(),
            log=self.root / "logs" / f"{self.monitor.host.name}.log",
        )
        self._wait(lambda: self._monitor_up(), "the monitor", proc=proc)
        for name, value in MONITOR_SETTINGS.items():
            self.monitor.sql(f"ALTER SYSTEM SET {name} = {value}")
        self.monitor.sql("SELECT pg_reload_conf()")
        self.monitor.sql(f"ALTER USER autoctl_node PASSWORD '{self._monitor_password}'", "pg_auto_failover")
        for i, node in enumerate(self.nodes):
            self._start_node(node, primary=i == 0)

    def _start_node(self, node: Node, *, primary: bool) -> None:
        options = self._prepare(node)
        create = [
            PG_AUTOCTL, "create", "postgres", *options,
            "--pghost", str(node.sockets),
            "--listen", node.host.address,
            "--name", node.host.name,
            "--dbname", DATABASE,
            "--monitor", self.monitor_url,
            "--run",
        ]  # fmt: skip
        # A standby copies the primary with the replication user's password.
        env = node.env(PGPASSWORD=self._replication_password)
        proc = node.host.spawn(_as_postgres(create), env=env, log=self.root / "logs" / f"{node.host.name}.log")
        want = "secondary" if not primary else "single"
        self._wait(lambda: self.state(node.host.name) in (want, "primary"), f"{node.host.name} {want}", proc=proc)
        node.autoctl("config", "set", "replication.password", self._replication_password)
        if primary:
            node.sql_once_up(f"ALTER USER pgautofailover_replicator PASSWORD '{self._replication_password}'")
            node.sql_once_up(
                f"DO $$ BEGIN CREATE ROLE {APP_USER} LOGIN PASSWORD '{self.app_password}'; "
                "EXCEPTION WHEN duplicate_object THEN NULL; END $$"
            )
            node.sql_once_up(f"ALTER DATABASE {DATABASE} OWNER TO {APP_USER}")
            # pg_basebackup (as pg_autoctl 2.0 runs it) waits for a spread checkpoint,
            # paced at 0.1 s a dirty buffer: one now leaves it nearly none to write.
            node.sql_once_up("CHECKPOINT")
        subnet = f"{node.host.address.rsplit('.', 1)[0]}.0/24"
        rules = [
            f"hostssl {DATABASE} {APP_USER} {subnet} scram-sha-256",
            # pg_rewind, which brings a demoted primary back as a standby, reads the
            # "postgres" database (without it pg_autoctl copies the whole cluster again).
            f"hostssl postgres pgautofailover_replicator {subnet} scram-sha-256",
        ]
        hba = node.pgdata / "pg_hba.conf"
        with open(hba, "a") as f:
            f.writelines(rule + "\n" for rule in rules if rule not in hba.read_text())
        for setting in ("wal_sender_timeout", "wal_receiver_timeout"):
            node.sql_once_up(f"ALTER SYSTEM SET {setting} = '{REPLICATION_TIMEOUT}'")
        node.sql_once_up("SELECT pg_reload_conf()")
        if not primary:
            self._wait(lambda: self.state(self.nodes[0].host.name) == "primary", "a primary with its standby")

    def _monitor_up(self) -> bool:
        try:
            return self.monitor.sql("SELECT 1", "pg_auto_failover").strip() == "1"
        except RuntimeError:
            return False

    def states(self) -> dict[str, tuple[str, str]]:
        """Each data node's (reported, assigned) state, as the monitor sees them."""
        rows = self.monitor.sql(
            "SELECT json_agg(json_build_array(nodename, reportedstate, goalstate)) FROM pgautofailover.node",
            "pg_auto_failover",
        )
        return {name: (reported, goal) for name, reported, goal in json.loads(rows.strip() or "[]") or []}

    def state(self, name: str) -> str:
        """The node's state where it and the monitor agree, else ``reported->goal``."""
        reported, goal = self.states().get(name, ("", ""))
        return reported if reported == goal else f"{reported}->{goal}"

    def primary(self) -> Node:
        states = self.states()
        return next(n for n in self.nodes if states.get(n.host.name, ("",))[0] == "primary")

    def _wait(self, ready, what: str, timeout: float = 120.0, proc=None) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{what}: pg_autoctl exited {proc.returncode}; see {self.root / 'logs'}")
            try:
                if ready():
                    return
            except (RuntimeError, StopIteration):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{what} not ready after {timeout}s; see {self.root / 'logs'}")
