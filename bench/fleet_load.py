"""A load model of the fleet: N fake samplers against one real control plane, and
what the control plane pays for them, for each N.

    python bench/fleet_load.py [--fleets 10,100,1000] [--hosts 4] [--decoders 2] [--schedulers 1]
    python bench/fleet_load.py --smoke      # CI's check that it still runs: 4 samplers, a second per phase

The control plane is ``darkroom up``'s (``LocalStack``): a durable PostgreSQL
(with pg_stat_statements preloaded), nats-server with JetStream (with its
monitoring port), the gateway, scheduler replica(s) and real decoder processes.
The N samplers are the real sampler service (``gpu_worker.service.serve``:
presence, JetStream dispatch, job store, events), several to a process
(``bench/support/fleet_host.py``), each with its own worker id and NATS user, running the
``sim`` model of ``bench/fleet_registry.toml``: no real tensors, only modelled
time (10 ms for a 64 px step). The scheduler is the real one with each placement
pass timed (``bench/support/fleet_scheduler.py``). Load comes from ``bench/support/loadgen.py``
(open loop, Poisson, from the seed) through the public gRPC API, as in
``bench/controlplane.py``.

Per N, on a fresh stack, in order:
1. idle: the fleet registered and nothing submitted, for ``--idle-seconds``: what
   presence alone costs (PostgreSQL connections, statements and commits per
   second, NATS messages and bytes per second). Presence is NATS traffic: each
   worker's heartbeat is a put to a JetStream key-value bucket
   (services/bus/presence_board.py), counted as the bucket stream's stored
   messages per second; readiness is judged from that bucket too (``presence_now``);
2. light load (``--light-rate``): the time the stack adds to a job (submit to the
   last image byte, minus the modelled sampling time);
3. saturation: rising offered rates until completions fall behind; the level that
   completed most gives jobs/s, and its PostgreSQL and NATS rates, connections
   and placement passes (p50/p99 of passes that read queued jobs) are reported;
4. backlog: ``--queued`` jobs of ``sim-held``, which no fake sampler can hold
   (it is larger than their memory budget), submitted and left queued; then the
   placement passes over ``--backlog-seconds`` with those queued and light load
   on top (and how many of that light load's jobs completed: queued work no
   sampler can hold must not block the jobs behind it).
It prints one table row per N, then each N's PostgreSQL statements by kind."""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg

from bench import controlplane
from bench.controlplane import KEEPS_UP, Run, percentile, run_load
from bench.support.fleet_host import IDS, RAMP
from bench.support.fleet_scheduler import PASS_LOG
from services.bus.dispatch import host_token
from services.bus.presence_board import STREAM as PRESENCE_STREAM
from services.config.sections import Settings
from services.mesh.nats_auth import sampler_user
from services.mesh.secrets import ensure_certificates
from services.ops.children import child
from services.ops.embedded_nats import EmbeddedNats
from services.ops.processes import free_port
from services.ops.stack import LocalStack
from services.ops.supervisor import Child
from services.telemetry.metrics import targets_path, write_targets

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
REGISTRY = HERE / "fleet_registry.toml"
HELD_MODEL = "sim-held"
# Fakes may hold models of this many MiB: `sim` (1) fits, `sim-held` does not.
FAKE_MEMORY_MB = 64
SMOKE = {
    "fleets": "4",
    "hosts": 1,
    "decoders": 1,
    "idle_seconds": 1.0,
    "light_rate": 5.0,
    "light_seconds": 1.0,
    "rates": "10,20",
    "seconds": 1.0,
    "queued": 40,
    "backlog_seconds": 1.0,
    "ramp_seconds": 0.0,
}


# -- the stack ---------------------------------------------------------------------


class MonitoredNats(EmbeddedNats):
    """The embedded nats-server with its HTTP monitoring endpoint (/varz) on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.http_port = free_port()

    def _write_config(self) -> None:
        super()._write_config()
        with open(self.config_path, "a") as out:
            out.write(f'http: "127.0.0.1:{self.http_port}"\n')

    def varz(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/varz", timeout=5) as reply:
            return dict(json.load(reply))

    def stream_sequences(self) -> dict[str, int]:
        """Each JetStream stream's last sequence: what was stored in it so far (a
        key-value bucket's stream counts its puts and deletes)."""
        url = f"http://127.0.0.1:{self.http_port}/jsz?accounts=true&streams=true"
        with urllib.request.urlopen(url, timeout=5) as reply:
            jsz = json.load(reply)
        return {
            stream["name"]: int(stream["state"]["last_seq"])
            for account in jsz.get("account_details", ())
            for stream in account.get("stream_detail", ())
        }


class FleetStack(LocalStack):
    """``darkroom up``'s stack without samplers of its own: NATS with monitoring,
    PostgreSQL with pg_stat_statements, and the scheduler timed per pass
    (``schedulers`` replicas of it). The fake samplers are added with
    ``add_fleet``."""

    def __init__(self, settings: Settings, *, decoders: int, schedulers: int, pass_log: Path, pooler: int = 0) -> None:
        super().__init__(settings, cpu_workers=0, decoders=decoders, durable=True)
        self.schedulers = schedulers
        self.pass_log = pass_log
        self.pooler_size = pooler  # server connections of the samplers' PgBouncer; 0: none
        self.bouncer: Any = None
        self.fleet_ids: list[str] = []

    @property
    def monitored_nats(self) -> MonitoredNats:
        assert isinstance(self.nats, MonitoredNats)
        return self.nats

    def start_backends(self) -> None:
        data = self.settings.kernel.data_dir
        data.mkdir(parents=True, exist_ok=True)
        ensure_certificates(data / "secrets")
        self.settings = self.settings.with_env({"DARKROOM_MESH_DIR": str(data / "secrets")})
        self.nats = MonitoredNats(data, mesh_dir=data / "secrets")
        self.nats.start()
        self.settings = self.settings.with_env({"DARKROOM_NATS_URL": self.nats.url})
        super().start_backends()  # PostgreSQL and the migrations: NATS is configured
        assert self.postgres is not None
        # pg_stat_statements must be loaded at the server's start: set, then restart.
        with psycopg.connect(self.pg_url, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
            conn.execute("ALTER SYSTEM SET pg_stat_statements.max = 10000")
        self.postgres.stop()
        self.postgres.start()
        with psycopg.connect(self.pg_url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")

    def add(self, name: str, service: str, env: dict[str, str] | None = None) -> Child:  # type: ignore[override]
        if service != "scheduler":
            return super().add(name, service, env)
        # The scheduler, each pass timed; with replicas, as many of them.
        first = None
        for i in range(self.schedulers):
            own = {"DARKROOM_METRICS_PORT": str(self.metrics_ports.next()), **(env or {})}
            if i:
                own["DARKROOM_METRICS_PORT"] = str(self.metrics_ports.next())
            replica = child(self.settings, name if i == 0 else f"{name}-{i}", service, own)
            replica.module = "bench.support.fleet_scheduler"
            replica.env[PASS_LOG] = str(self.pass_log)
            replica.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
            self.supervisor.add(replica)
            first = first or replica
        write_targets(targets_path(self.settings.kernel.data_dir), self.metrics_targets())
        assert first is not None
        return first

    def add_fleet(self, samplers: int, hosts: int, ramp_s: float) -> None:
        """``samplers`` fake samplers in ``hosts`` processes, each with its own NATS user."""
        token = host_token()
        ids = [f"{token}-fake{i:04d}" for i in range(samplers)]
        self.fleet_ids = ids
        self.monitored_nats.set_users([*self.monitored_nats.users, *map(sampler_user, ids)])
        hosts = max(1, min(hosts, samplers))
        pooled: dict[str, str] = {}
        if self.pooler_size:
            from services.ops.pgbouncer import PgBouncer

            self.bouncer = PgBouncer(
                self.settings.kernel.data_dir / "pgbouncer",
                self.settings.kernel.database_url,
                pool_size=self.pooler_size,
                max_db_connections=self.pooler_size,
            )
            self.bouncer.start()
            pooled = {"DARKROOM_DATABASE_URL": self.bouncer.url, "DARKROOM_DATABASE_POOLED": "true"}
        for h in range(hosts):
            mine = ids[h::hosts]
            env = {
                "DARKROOM_DEVICE": "cpu",
                "DARKROOM_METRICS_PORT": "0",  # many samplers, one process: no port each
                "DARKROOM_MEMORY_BUDGET_MB": str(FAKE_MEMORY_MB),
                "OMP_NUM_THREADS": "1",
                IDS: ",".join(mine),
                RAMP: str(ramp_s),
                **pooled,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            }
            host = child(self.settings, f"fleet-{h}", "sampler", env)
            host.module = "bench.support.fleet_host"
            host.liveness_path = None  # a host of hundreds may turn its loop slowly: not a hang
            self.supervisor.add(host)


def stop_stack(stack: FleetStack) -> None:
    stack.stop()
    if stack.bouncer is not None:
        stack.bouncer.stop()
    if stack.postgres is not None and not stack.postgres.running:
        stack.postgres.discard()


def start_stack(data_dir: Path, args: argparse.Namespace, samplers: int) -> FleetStack:
    settings = Settings.from_env(
        {
            "DARKROOM_DATA_DIR": str(data_dir),
            "DARKROOM_GATEWAY_PORT": "0",
            "DARKROOM_MODEL_REGISTRY": str(REGISTRY),
            "DARKROOM_PRELOAD_MODELS": controlplane.MODEL,
            "DARKROOM_LOG_LEVEL": "WARNING",
            "DARKROOM_IMAGE_FILTER": str(not args.no_image_filter).lower(),
        }
    )
    stack = FleetStack(
        settings,
        decoders=args.decoders,
        schedulers=args.schedulers,
        pass_log=data_dir / "passes.log",
        pooler=args.pooler,
    )
    try:
        stack.start(timeout=180)
        started = time.monotonic()
        stack.add_fleet(samplers, args.hosts, args.ramp_seconds)
        stack.wait_ready(args.ramp_seconds + 60 + samplers * 0.5, samplers=samplers)
    except BaseException:  # not ready, or interrupted: nothing it started outlives it
        stop_stack(stack)
        raise
    print(f"  {samplers} samplers ready in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return stack


# -- what the control plane pays ------------------------------------------------------

_VERB = re.compile(r"^\s*(\w+)")
_MONITOR = "darkroom-bench-monitor"


def kind(query: str) -> str:
    """A statement's kind: its verb and the table it acts on ("UPDATE workers"); a
    WITH takes the verb of the first write in it, else SELECT."""
    text = " ".join(query.split())
    verb_match = _VERB.match(text)
    verb = verb_match.group(1).upper() if verb_match else "?"
    if verb == "WITH":
        writes = re.search(r"\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+([a-z_][a-z0-9_]*)", text, re.I)
        if writes:
            return f"{writes.group(1).split()[0].upper()} {writes.group(2).lower()}"
        verb = "SELECT"
    target = {"INSERT": r"\bINTO", "UPDATE": r"^UPDATE", "DELETE": r"\bFROM"}.get(verb, r"\bFROM")
    table = re.search(target + r"\s+([a-z_][a-z0-9_]*)", text, re.I)
    if verb not in ("SELECT", "INSERT", "UPDATE", "DELETE"):
        return verb
    return f"{verb} {table.group(1).lower()}" if table else verb


@dataclass
class PgSnapshot:
    at: float
    commits: int
    rollbacks: int
    statements: dict[str, int]  # calls by queryid's text
    monitor_xacts: int


@dataclass
class NatsSnapshot:
    at: float
    in_msgs: int
    out_msgs: int
    in_bytes: int
    out_bytes: int
    connections: int
    streams: dict[str, int]  # each JetStream stream's last sequence


class Monitor:
    """Samples PostgreSQL's connections (peak, by service) every ``every_s`` in a
    thread, and takes snapshots of its statement counts and NATS's counters."""

    def __init__(self, stack: FleetStack, every_s: float = 0.5) -> None:
        self.stack = stack
        self.every_s = every_s
        self.conn = psycopg.connect(stack.pg_url, autocommit=True, application_name=_MONITOR)
        self.lock = threading.Lock()
        self.xacts = 0  # the monitor's own transactions, taken out of the commits
        self.peak = 0
        self.peak_by: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _execute(self, sql: str) -> list[tuple[Any, ...]]:
        with self.lock:
            self.xacts += 1
            return self.conn.execute(sql).fetchall()

    def connections(self) -> dict[str, int]:
        rows = self._execute(
            "SELECT CASE WHEN client_addr IS NULL THEN application_name ELSE 'darkroom-pgbouncer' END, count(*) "
            "FROM pg_stat_activity "
            f"WHERE backend_type = 'client backend' AND application_name <> '{_MONITOR}' GROUP BY 1"
        )
        by: dict[str, int] = collections.Counter()
        for name, n in rows:
            # darkroom-sampler-<id>, darkroom-gateway, darkroom-scheduler-<pid>: by service
            service = name.removeprefix("darkroom-").split("-")[0] if name else "other"
            by[service] += n
        return dict(by)

    def start_window(self) -> None:
        self.peak, self.peak_by = 0, {}
        self._stop.clear()

        def sample() -> None:
            while not self._stop.wait(self.every_s):
                try:
                    by = self.connections()
                except psycopg.Error:
                    continue
                total = sum(by.values())
                if total > self.peak:
                    self.peak, self.peak_by = total, by

        by = self.connections()
        self.peak, self.peak_by = sum(by.values()), by
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()

    def end_window(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def pg(self) -> PgSnapshot:
        [(commits, rollbacks)] = self._execute(
            "SELECT xact_commit, xact_rollback FROM pg_stat_database WHERE datname = current_database()"
        )
        rows = self._execute(
            "SELECT query, calls FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid "
            "WHERE d.datname = current_database()"
        )
        statements: dict[str, int] = collections.Counter()
        for query, calls in rows:
            if "pg_stat" in query:  # the monitor's own
                continue
            statements[query] += calls
        return PgSnapshot(time.perf_counter(), commits, rollbacks, dict(statements), self.xacts)

    def nats(self) -> NatsSnapshot:
        v = self.stack.monitored_nats.varz()
        return NatsSnapshot(
            time.perf_counter(),
            v["in_msgs"],
            v["out_msgs"],
            v["in_bytes"],
            v["out_bytes"],
            v["connections"],
            self.stack.monitored_nats.stream_sequences(),
        )

    def close(self) -> None:
        self.end_window()
        self.conn.close()


@dataclass
class Window:
    """What the control plane paid over one phase."""

    seconds: float
    connections_peak: int
    connections_by: dict[str, int]
    commits_s: float
    statements_s: float
    kinds_s: dict[str, float]
    nats_in_msgs_s: float
    nats_out_msgs_s: float
    nats_in_kb_s: float
    nats_out_kb_s: float
    nats_connections: int
    presence_puts_s: float  # writes to presence's key-value bucket (heartbeats, plans, stops)
    streams_s: dict[str, float]  # messages stored per second, by JetStream stream


def window(monitor: Monitor, before: tuple[PgSnapshot, NatsSnapshot], after: tuple[PgSnapshot, NatsSnapshot]) -> Window:
    (pg0, n0), (pg1, n1) = before, after
    seconds = max(pg1.at - pg0.at, 1e-9)
    kinds: dict[str, float] = collections.defaultdict(float)
    for query, calls in pg1.statements.items():
        delta = calls - pg0.statements.get(query, 0)
        if delta > 0:
            kinds[kind(query)] += delta / seconds
    # The monitor's own transactions (its pg_stat reads) are not the control plane's.
    commits = (pg1.commits - pg0.commits) - (pg1.monitor_xacts - pg0.monitor_xacts)
    nats_s = max(n1.at - n0.at, 1e-9)
    return Window(
        seconds=seconds,
        connections_peak=monitor.peak,
        connections_by=monitor.peak_by,
        commits_s=max(commits, 0) / seconds,
        statements_s=sum(kinds.values()),
        kinds_s=dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        nats_in_msgs_s=(n1.in_msgs - n0.in_msgs) / nats_s,
        nats_out_msgs_s=(n1.out_msgs - n0.out_msgs) / nats_s,
        nats_in_kb_s=(n1.in_bytes - n0.in_bytes) / nats_s / 1024,
        nats_out_kb_s=(n1.out_bytes - n0.out_bytes) / nats_s / 1024,
        nats_connections=n1.connections,
        presence_puts_s=(n1.streams.get(PRESENCE_STREAM, 0) - n0.streams.get(PRESENCE_STREAM, 0)) / nats_s,
        streams_s={name: (seq - n0.streams.get(name, 0)) / nats_s for name, seq in sorted(n1.streams.items())},
    )


def measured(monitor: Monitor, phase: Any) -> tuple[Window, Any]:
    """Runs ``phase()`` and returns what the control plane paid meanwhile, with its result."""
    monitor.start_window()
    before = (monitor.pg(), monitor.nats())
    result = phase()
    after = (monitor.pg(), monitor.nats())
    monitor.end_window()
    return window(monitor, before, after), result


# -- placement passes ------------------------------------------------------------------


@dataclass
class Passes:
    working: list[float]  # seconds of each pass that read queued jobs
    empty: int  # passes that read none (nothing queued, or another replica's turn)
    queued_read: int  # the most queued jobs one pass read
    workers_read: int  # the most live samplers one pass read

    @property
    def p50_ms(self) -> float:
        return percentile(self.working, 50) * 1000

    @property
    def p99_ms(self) -> float:
        return percentile(self.working, 99) * 1000


def passes_between(log: Path, start: float, end: float) -> Passes:
    working, empty, queued, workers = [], 0, 0, 0
    if log.exists():
        for line in log.read_text().splitlines():
            parts = line.split()
            if len(parts) != 5:
                continue
            at, took, q, w = float(parts[0]), float(parts[1]), int(parts[2]), int(parts[3])
            if not start <= at <= end:
                continue
            if q < 0:
                empty += 1
                continue
            working.append(took)
            queued, workers = max(queued, q), max(workers, w)
    return Passes(working, empty, queued, workers)


# -- the backlog -------------------------------------------------------------------


async def submit_backlog(address: str, jobs: int, seed: int, concurrency: int = 32) -> tuple[int, list[str]]:
    """Submits ``jobs`` jobs of the held model (no fake serves it: they stay queued)."""
    import grpc

    from bench.support import loadgen
    from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc

    config = loadgen.Config(
        address=address,
        rate=1.0,
        seconds=1.0,
        seed=seed,
        mode="stream",
        model=HELD_MODEL,
        size=controlplane.SIZE,
        steps=controlplane.STEPS,
        label="backlog",
    )
    channels = [grpc.aio.insecure_channel(address) for _ in range(4)]
    stubs = [image_generation_pb2_grpc.ImageGenerationStub(ch) for ch in channels]
    errors: list[str] = []
    done = 0
    indices = iter(range(jobs))

    async def worker(k: int) -> None:
        nonlocal done
        for i in indices:
            try:
                await stubs[k % len(stubs)].SubmitJob(loadgen.request(config, i), timeout=60)
                done += 1
            except grpc.aio.AioRpcError as exc:
                errors.append(f"{exc.code().name}: {exc.details()}")

    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    for ch in channels:
        await ch.close()
    return done, errors


def queued_jobs(monitor: Monitor) -> int:
    [(n,)] = monitor._execute("SELECT count(*) FROM jobs WHERE status = 'QUEUED'")
    return int(n)


# -- one fleet size ----------------------------------------------------------------------


@dataclass
class Result:
    samplers: int
    hosts: int
    idle: Window
    light: Run
    light_window: Window
    saturation: Run
    saturation_window: Window
    saturation_passes: Passes
    ladder: list[Run]
    backlog_queued: int
    backlog_window: Window | None = None
    backlog_passes: Passes | None = None
    backlog_light: Run | None = None
    submit_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def run_fleet(args: argparse.Namespace, samplers: int, modelled: float) -> Result:
    data_dir = Path(tempfile.mkdtemp(prefix="darkroom-fleet-"))
    stack: FleetStack | None = None
    monitor: Monitor | None = None
    try:
        print(f"# N = {samplers}: starting", file=sys.stderr)
        stack = start_stack(data_dir, args, samplers)
        monitor = Monitor(stack)
        run_load(stack, 20, args.warmup_seconds, "stream", args.seed + 999, "warmup", profile=False)

        idle, _ = measured(monitor, lambda: time.sleep(args.idle_seconds))
        print(f"  idle: {idle.statements_s:.0f} statements/s, {idle.connections_peak} connections", file=sys.stderr)

        light_window, light = measured(
            monitor,
            lambda: run_load(stack, args.light_rate, args.light_seconds, "stream", args.seed + 100, "light", False),
        )

        ladder: list[tuple[Window, Run, Passes]] = []
        for i, rate in enumerate(float(r) for r in args.rates.split(",")):
            started = time.time()
            win, run = measured(
                monitor,
                lambda rate=rate, i=i: run_load(stack, rate, args.seconds, "stream", args.seed + i, f"r{i}", False),
            )
            ladder.append((win, run, passes_between(stack.pass_log, started, time.time())))
            print(f"  offered {rate:.0f}/s: completed {run.achieved:.0f}/s", file=sys.stderr)
            # Against what actually arrived (a Poisson draw), not the nominal rate.
            arrived = len(run.records) / args.seconds
            if run.achieved < KEEPS_UP * arrived or len(run.done) < len(run.records):
                break
        sat_window, saturation, sat_passes = max(ladder, key=lambda x: x[1].achieved)

        result = Result(
            samplers,
            min(args.hosts, samplers),
            idle,
            light,
            light_window,
            saturation,
            sat_window,
            sat_passes,
            [r for _, r, _ in ladder],
            0,
        )
        if args.queued:
            started = time.perf_counter()
            _, errors = asyncio.run(submit_backlog(stack.gateway_address, args.queued, args.seed + 7))
            result.submit_s = time.perf_counter() - started
            if errors:
                result.notes.append(f"{len(errors)} backlog submits refused: {sorted(set(errors))[:2]}")
            result.backlog_queued = queued_jobs(monitor)
            print(f"  backlog: {result.backlog_queued} queued in {result.submit_s:.0f}s", file=sys.stderr)
            started_t = time.time()
            backlog_window, backlog_light = measured(
                monitor,
                lambda: run_load(
                    stack, args.light_rate, args.backlog_seconds, "stream", args.seed + 200, "backlog", False
                ),
            )
            result.backlog_window = backlog_window
            result.backlog_light = backlog_light
            result.backlog_passes = passes_between(stack.pass_log, started_t, time.time())
        return result
    finally:
        if monitor is not None:
            monitor.close()
        if stack is not None:
            stop_stack(stack)
        if not args.keep:
            shutil.rmtree(data_dir, ignore_errors=True)


# -- report --------------------------------------------------------------------------


def fmt(x: float, digits: int = 0) -> str:
    return "n/a" if x != x else f"{x:,.{digits}f}"


def added_ms(run: Run | None, modelled: float, q: float) -> float:
    if run is None:
        return float("nan")
    return percentile([(r["end_to_end_s"] - modelled) * 1000 for r in run.done], q)


HEADER = (
    "| N samplers | hosts | PG conns idle / peak | PG stmts/s idle | PG commits/s idle | NATS msgs/s idle (in/out) "
    "| NATS KB/s idle (in/out) | presence KV puts/s idle / sat | jobs/s at saturation | PG stmts/s sat "
    "| PG commits/s sat | PG stmts / job | NATS msgs/s sat (in/out) | pass p50/p99 ms sat | pass p50/p99 ms, Q queued "
    "| Q | light jobs done / sent, Q queued | added ms light p50/p99 | added ms light p50/p99, Q queued "
    "| CPU cores sat |"
)


def row(r: Result, modelled: float) -> str:
    sat = r.saturation
    sw = r.saturation_window
    jobs = max(len(sat.done), 1)
    per_job = sw.statements_s * sw.seconds / jobs
    bp = r.backlog_passes
    backlog = f"{fmt(bp.p50_ms, 1)} / {fmt(bp.p99_ms, 1)}" if bp is not None and bp.working else "n/a"
    cpu = sum(sat.cpu.values()) / max(sat.wall_s, 1e-9)
    bl = r.backlog_light
    backlog_done = f"{len(bl.done)} / {len(bl.records)}" if bl is not None else "n/a"
    windows = [r.idle, r.light_window, sw, *([r.backlog_window] if r.backlog_window else [])]
    peak = max(w.connections_peak for w in windows)
    return (
        f"| {r.samplers:,} | {r.hosts} | {r.idle.connections_peak} / {peak} "
        f"| {fmt(r.idle.statements_s)} | {fmt(r.idle.commits_s)} "
        f"| {fmt(r.idle.nats_in_msgs_s)} / {fmt(r.idle.nats_out_msgs_s)} "
        f"| {fmt(r.idle.nats_in_kb_s)} / {fmt(r.idle.nats_out_kb_s)} "
        f"| {fmt(r.idle.presence_puts_s)} / {fmt(sw.presence_puts_s)} "
        f"| {fmt(sat.achieved)} | {fmt(sw.statements_s)} | {fmt(sw.commits_s)} | {fmt(per_job, 1)} "
        f"| {fmt(sw.nats_in_msgs_s)} / {fmt(sw.nats_out_msgs_s)} "
        f"| {fmt(r.saturation_passes.p50_ms, 1)} / {fmt(r.saturation_passes.p99_ms, 1)} "
        f"| {backlog} | {r.backlog_queued:,} | {backlog_done} "
        f"| {fmt(added_ms(r.light, modelled, 50), 1)} / {fmt(added_ms(r.light, modelled, 99), 1)} "
        f"| {fmt(added_ms(bl, modelled, 50), 1)} / {fmt(added_ms(bl, modelled, 99), 1)} "
        f"| {cpu:.2f} |"
    )


def kinds_table(results: list[Result], top: int) -> str:
    """Statements per second by kind, idle and at saturation, per N."""
    names: dict[str, float] = collections.defaultdict(float)
    for r in results:
        for k, v in r.idle.kinds_s.items():
            names[k] += v
        for k, v in r.saturation_window.kinds_s.items():
            names[k] += v
    kinds = sorted(names, key=lambda k: -names[k])[:top]
    head = "| kind | " + " | ".join(f"N={r.samplers:,} idle | N={r.samplers:,} sat" for r in results) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(results))]
    for k in kinds:
        cells = []
        for r in results:
            cells += [fmt(r.idle.kinds_s.get(k, 0.0), 1), fmt(r.saturation_window.kinds_s.get(k, 0.0), 1)]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def detail(r: Result, modelled: float) -> str:
    out = [f"- N={r.samplers:,}:"]
    out.append(
        f"  peak connections by service, idle {r.idle.connections_by}, saturation {r.saturation_window.connections_by}"
    )
    ladder = ", ".join(f"{run.rate:.0f}->{run.achieved:.0f}" for run in r.ladder)
    out.append(f"  ladder offered->completed jobs/s: {ladder}")
    cpu = {k: round(v / max(r.saturation.wall_s, 1e-9), 2) for k, v in sorted(r.saturation.cpu.items())}
    out.append(f"  CPU cores by service at saturation: {cpu}")
    sp = r.saturation_passes
    out.append(
        f"  passes at saturation: {len(sp.working)} that read queued jobs (up to {sp.queued_read} jobs, "
        f"{sp.workers_read} samplers), {sp.empty} that read none"
    )
    if r.backlog_passes is not None:
        bp = r.backlog_passes
        out.append(
            f"  backlog: {r.backlog_queued:,} queued (submitted in {r.submit_s:.1f}s); {len(bp.working)} passes "
            f"read up to {bp.queued_read} queued jobs and {bp.workers_read} samplers; light load meanwhile added "
            f"{fmt(added_ms(r.backlog_light, modelled, 50), 1)} / {fmt(added_ms(r.backlog_light, modelled, 99), 1)} ms "
            f"p50/p99 ({len(r.backlog_light.done) if r.backlog_light else 0} jobs)"
        )
    out.append(f"  NATS connections: {r.idle.nats_connections}; light-load added latency over {len(r.light.done)} jobs")
    for name, w in (("idle", r.idle), ("saturation", r.saturation_window)):
        stored = {k: round(v, 1) for k, v in w.streams_s.items() if v}
        out.append(f"  JetStream messages stored per second, {name} (presence is {PRESENCE_STREAM}): {stored}")
    out += [f"  note: {n}" for n in r.notes]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fleets", default="10,100,1000", help="fake samplers, per run")
    parser.add_argument("--hosts", type=int, default=4, help="processes the fake samplers share")
    parser.add_argument("--decoders", type=int, default=2, help="decoder processes (real, CPU)")
    parser.add_argument("--schedulers", type=int, default=1, help="scheduler replicas")
    parser.add_argument("--ramp-seconds", type=float, default=10.0, help="fake samplers' starts spread over this")
    parser.add_argument("--warmup-seconds", type=float, default=2.0)
    parser.add_argument("--idle-seconds", type=float, default=10.0, help="how long presence alone is measured")
    parser.add_argument("--light-rate", type=float, default=10.0, help="jobs/s of the light load")
    parser.add_argument("--light-seconds", type=float, default=20.0)
    parser.add_argument("--rates", default="100,200,300,400,600,800,1000,1200", help="offered jobs/s, rising")
    parser.add_argument("--seconds", type=float, default=8.0, help="how long each offered rate lasts")
    parser.add_argument("--queued", type=int, default=10_000, help="jobs left queued for the backlog's passes")
    parser.add_argument("--backlog-seconds", type=float, default=10.0)
    parser.add_argument(
        "--pooler",
        type=int,
        default=0,
        metavar="SIZE",
        help="the fake samplers reach PostgreSQL through a PgBouncer (transaction mode) of SIZE server connections",
    )
    parser.add_argument(
        "--no-image-filter",
        action="store_true",
        help="the control plane alone: no output scored (a GPU decoder scores on its GPU, not its host's cores)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", action="store_true", help="keep each stack's data directory (logs)")
    parser.add_argument("--smoke", action="store_true", help=f"small values for CI: {SMOKE}; given options win")
    args = parser.parse_args(argv)
    if args.smoke:
        parser.set_defaults(**SMOKE)
        args = parser.parse_args(argv)

    # Every process of the stack runs this tree's code (the one this script is in).
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    modelled = controlplane.modelled_s()
    fleets = [int(n) for n in args.fleets.split(",")]
    print(
        f"# Fleet load: sim model, {controlplane.SIZE}x{controlplane.SIZE}, {controlplane.STEPS} step "
        f"(modelled {modelled * 1000:.1f} ms); {args.decoders} decoders, {args.schedulers} scheduler(s), "
        f"{os.cpu_count()} cores; seed {args.seed}"
        + (f"; samplers through PgBouncer ({args.pooler} server connections)" if args.pooler else "")
        + "\n"
    )
    results = [run_fleet(args, n, modelled) for n in fleets]

    print("## Control plane cost per fleet size\n")
    print(HEADER)
    print("|" + "---|" * HEADER.count(" |"))
    for r in results:
        print(row(r, modelled))
    print(
        "\nidle: registered, nothing submitted; sat: the offered rate that completed most; pass: the scheduler's "
        "placement passes that read queued jobs; Q: jobs queued (of a model no sampler holds) during the "
        "backlog's passes, with light load on top\n"
    )
    print("## PostgreSQL statements per second by kind (verb and first table)\n")
    print(kinds_table(results, top=16))
    print()
    for r in results:
        print(detail(r, modelled))
    for r in results:
        if not r.saturation.done:
            print(f"error: N={r.samplers}: no job completed", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
