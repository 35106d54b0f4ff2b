"""The fault-injection suite: jobs run through the gRPC API while something breaks,
then one checker asserts that nothing was lost and nothing happened twice.
Real processes, a real PostgreSQL and real nats-servers; each scenario is short."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import psutil
import psycopg
import pytest

from services.bus.dispatch import host_token
from services.mesh.nats_auth import CONTROL_USERS, sampler_user
from services.mesh.secrets import ensure_certificates
from services.models.parallel_miniatures import write_registry
from services.ops.embedded import EmbeddedPostgres
from services.ops.embedded_nats import EmbeddedNatsCluster
from services.ops.lifecycle import EXIT_UNFIT
from services.ops.stack import LocalStack
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.conftest import fresh_database
from tests.faults.harness import Load, check, fault_stack, now, stop_and_check_processes, up_metric
from tests.helpers import CHECKPOINTED_MEDIA, CHECKPOINTED_TINY, wait_for, wait_terminal

pytestmark = pytest.mark.faults


@pytest.fixture
def make(tmp_path: Path, postgres: EmbeddedPostgres, models_dir: Path) -> Iterator:
    """Builds and starts a stack (on the session's PostgreSQL unless told
    otherwise); stops it afterwards and checks that no process outlived it."""
    stacks: list[LocalStack] = []

    def build(*, own_postgres: bool = False, **overrides) -> LocalStack:
        url = "" if own_postgres else fresh_database(postgres)
        # A stack's own server is there to be killed: its commits must be
        # synchronous, as in production, or a crash loses acknowledged submits.
        stack = fault_stack(
            tmp_path / f"stack{len(stacks)}", models_dir, database_url=url, durable=own_postgres, **overrides
        )
        stacks.append(stack)
        stack.start()
        return stack

    yield build
    for stack in stacks:
        stop_and_check_processes(stack)
        if stack.postgres is not None:
            stack.postgres.discard()  # as root, its cluster lives outside the temporary directory


def first_job(load: Load, ids: list[str], matches: Callable[[pb.Job], bool], what: str) -> pb.Job:
    """The first of ``ids`` seen to match: the moment to break something."""
    found = wait_for(
        lambda: next((j for j in map(load.get, ids) if matches(j)), None),
        lambda j: j is not None,
        timeout=60,
        what=what,
    )
    assert found is not None
    return found


def running_job(load: Load, ids: list[str], *, min_step: int) -> pb.Job:
    return first_job(
        load,
        ids,
        lambda j: j.status == pb.JOB_STATUS_RUNNING and j.progress.step >= min_step,
        f"a job running past step {min_step}",
    )


def sampler_of(stack: LocalStack, worker_id: str) -> str:
    return next(n for n, c in stack.services.items() if c.env.get("DARKROOM_WORKER_ID") == worker_id)


def test_sampler_killed_mid_sampling(make) -> None:
    stack = make()
    load = Load.of(stack)
    ids = load.submit(8)
    victim = running_job(load, ids, min_step=10)
    name = sampler_of(stack, victim.worker_id)
    stack.services[name].kill()
    fault_at = now()
    check("sampler `kill -9` mid-sampling", stack.pg_url, load, fault_at=fault_at)
    job = load.get(victim.job_id)
    assert job.attempts >= 2 and job.starts == 2
    assert [f.worker_id for f in job.failed_attempts] == [victim.worker_id]
    stats = {w.worker_id: w for w in load.stub.GetStats(pb.GetStatsRequest()).workers}
    assert stats[victim.worker_id].restarts == 1 and stats[victim.worker_id].state == "ready"


def test_decoder_killed_mid_decode_stream(make) -> None:
    # The frozen decoder must stay a candidate until its kill, neither judged stale
    # nor killed as hung by its supervisor first: this scenario is the kill.
    stack = make(decoders=2, worker_stale_after_s=60.0, hang_after_s=60.0)
    load = Load.of(stack)
    # Frozen first, so that a decode the sampler sends it stays open; then killed
    # with that stream open. Decodes sent to the other decoder finish; one that has
    # been decoding for a while is the frozen decoder's.
    decoder = stack.services["decoder-0"]
    decoder.signal(signal.SIGSTOP)
    ids = load.submit(6, width=256, height=256, steps=4, num_images=2)

    def hanging(job: pb.Job) -> bool:
        if job.status != pb.JOB_STATUS_DECODING:
            return False
        since = job.timings.decoding_time.ToDatetime(tzinfo=UTC)
        return (datetime.now(UTC) - since).total_seconds() > 1.5

    stuck = first_job(load, ids, hanging, "a job decoding on the frozen decoder")
    decoder.kill()
    fault_at = now()
    check(
        "decoder `kill -9` mid-stream",
        stack.pg_url,
        load,
        fault_at=fault_at,
        recovered=lambda rows: rows[stuck.job_id]["finished_at"],
    )
    job = load.get(stuck.job_id)
    assert job.attempts == 1 and not job.failed_attempts, "retried on the other decoder within the same attempt"


def lock_holder_pid(stack: LocalStack) -> int | None:
    """The OS pid of the scheduler replica holding the scheduler lock, if one does."""
    from services.db.repository import SCHEDULER_LOCK

    with psycopg.connect(stack.pg_url) as conn:
        row = conn.execute(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s AND l.objid = %s"
            " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            (SCHEDULER_LOCK >> 32, SCHEDULER_LOCK & 0xFFFFFFFF),
        ).fetchone()
    return int(row[0].rsplit("-", 1)[1]) if row else None


def test_working_scheduler_killed_with_another_running(make) -> None:
    stack = make()
    stack.add("scheduler-b", "scheduler")
    load = Load.of(stack)
    ids = load.submit(10)
    running_job(load, ids, min_step=1)
    by_pid = {c.pid: c for n, c in stack.services.items() if n.startswith("scheduler")}
    holder = wait_for(lambda: lock_holder_pid(stack), lambda pid: pid in by_pid, timeout=30, what="a lock holder")
    by_pid[holder].kill()
    fault_at = now()
    check("working scheduler replica `kill -9`, another running", stack.pg_url, load, fault_at=fault_at)


def test_only_scheduler_killed_under_supervision(make) -> None:
    stack = make()
    load = Load.of(stack)
    ids = load.submit(10)
    running_job(load, ids, min_step=1)
    scheduler = stack.services["scheduler"]
    first = scheduler.pid
    scheduler.kill()
    fault_at = now()
    check("only scheduler `kill -9`, restarted by its supervisor", stack.pg_url, load, fault_at=fault_at)
    assert scheduler.pid not in (None, first)


def test_hung_sampler_is_replaced(make) -> None:
    """Over 30 s: a hung sampler is noticed only after its hang timeout (5 s) and replaced
    by a fresh process loading its model."""
    stack = make()
    load = Load.of(stack)
    ids = load.submit(8)
    victim = running_job(load, ids, min_step=5)
    sampler = stack.services[sampler_of(stack, victim.worker_id)]
    frozen = sampler.pid
    sampler.signal(signal.SIGSTOP)
    fault_at = now()
    check("sampler `SIGSTOP` (hung) until replaced", stack.pg_url, load, fault_at=fault_at)
    assert sampler.pid not in (None, frozen), "the supervisor replaced the hung sampler"
    assert load.get(victim.job_id).starts == 2


def test_nats_killed_under_up_is_restarted_by_it(make) -> None:
    # The outage lasts nats-server's start, and `up`'s backoff of 3 s before it
    # where the server had not been up a minute yet.
    stack = make(restart_backoff_s=3.0, restart_backoff_max_s=3.0)
    assert stack.nats is not None and stack.nats.proc is not None
    load = Load.of(stack)
    ids = load.submit(12)
    running_job(load, ids, min_step=5)
    killed = stack.nats.proc.pid
    os.kill(killed, signal.SIGKILL)  # as the OOM killer would; nobody starts it by hand
    fault_at = now()
    during = load.submit(4)
    wait_for(
        lambda: up_metric(stack, "darkroom_backend_restarts_total", backend="nats"),
        lambda n: n == 1,
        timeout=60,
        what="`up` to start nats-server again",
    )
    after = load.submit(2)
    check("nats-server `kill -9` under `darkroom up`, restarted by it", stack.pg_url, load, fault_at=fault_at)
    assert len(during) == 4 and len(after) == 2
    assert up_metric(stack, "darkroom_backend_up", backend="nats") == 1
    assert stack.nats.proc is not None and stack.nats.proc.pid != killed
    assert not_left_a_zombie(killed)


def test_postgres_killed_under_up_is_restarted_by_it_submits_included(make) -> None:
    # The outage lasts PostgreSQL's start (seconds), and `up`'s backoff of 3 s
    # before it where the server had not been up a minute yet.
    stack = make(own_postgres=True, restart_backoff_s=3.0, restart_backoff_max_s=3.0)
    assert stack.postgres is not None and stack.postgres.proc is not None
    load = Load.of(stack)
    ids = load.submit(6)
    running_job(load, ids, min_step=5)
    assert up_metric(stack, "darkroom_backend_restarts_total", backend="postgres") == 0
    # The postmaster alone, as the OOM killer or `kill -9` would: its backends
    # notice and exit by themselves.
    killed = stack.postgres.proc.pid
    backends = psutil.Process(killed).children()
    os.kill(killed, signal.SIGKILL)
    fault_at = now()
    # Submitted once no backend is left to answer (they exit as they notice, within
    # moments): a submit sent in those moments is stored, and the refusal this row
    # checks would depend on the race.
    psutil.wait_procs(backends, timeout=30)
    during = [load.start(width=64, height=64, steps=40) for _ in range(4)]
    wait_for(
        lambda: up_metric(stack, "darkroom_backend_restarts_total", backend="postgres"),
        lambda n: n == 1,
        timeout=60,
        what="`up` to start PostgreSQL again",
    )
    after = load.submit(2)
    check(
        "PostgreSQL `kill -9` under `darkroom up`, restarted by it, submits included",
        stack.pg_url,
        load,
        fault_at=fault_at,
    )
    assert len(after) == 2
    refusals = {code for f in during for code in f.log.refusals}
    assert refusals == {grpc.StatusCode.UNAVAILABLE}, refusals
    assert up_metric(stack, "darkroom_backend_up", backend="postgres") == 1
    assert stack.postgres.proc is not None and stack.postgres.proc.pid != killed
    assert not_left_a_zombie(killed)


def not_left_a_zombie(pid: int) -> bool:
    """The dead process was reaped by its parent (the stack): none left waiting."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_nats_cluster_loses_a_node(make, tmp_path: Path) -> None:
    """Over 30 s: a three-node NATS cluster is started and one node is killed and waited
    out while jobs run."""
    # The operator's NATS, sealed with the fleet's CA, lists the stack's sampler.
    secrets = tmp_path / "secrets"
    ensure_certificates(secrets)
    users = [*CONTROL_USERS, sampler_user(f"{host_token()}-cpu0")]
    cluster = EmbeddedNatsCluster(tmp_path / "nats", mesh_dir=secrets, users=users)
    cluster.start()
    try:
        stack = make(nats_url=cluster.url, nats_replicas=3, mesh_dir=secrets)
        load = Load.of(stack)
        ids = load.submit(12)
        running_job(load, ids, min_step=5)
        cluster.nodes[0].kill()
        fault_at = now()
        load.submit(4)
        check("three-node NATS cluster loses a node", stack.pg_url, load, fault_at=fault_at)
    finally:
        cluster.stop()


def test_client_stream_cut_and_reopened(make) -> None:
    stack = make()
    load = Load.of(stack)
    [job_id] = load.submit(1, width=256, height=256, steps=40)
    running_job(load, [job_id], min_step=3)
    stack.services["gateway"].kill()
    fault_at = now()
    check(
        "a client's stream cut mid-job, then reopened",
        stack.pg_url,
        load,
        fault_at=fault_at,
        recovered=lambda rows: now(),
    )
    [followed] = load.jobs
    assert followed.log.opened >= 2, "the stream broke and was reopened"
    assert len(followed.results) == 1


def test_sampler_killed_during_a_long_job_resumes_from_its_checkpoint(make, tmp_path: Path) -> None:
    """Over 30 s: the sampler killed mid-job is restarted, and the job waits for the
    crash to be noticed before it runs its remaining steps."""
    registry = tmp_path / "registry.toml"
    registry.write_text(CHECKPOINTED_TINY)
    stack = make(model_registry=str(registry))
    load = Load.of(stack)
    steps = 60  # checkpointed every 5: a crash costs at most 5 steps, well inside the 20 % allowed
    [job_id] = load.submit(1, width=256, height=256, steps=steps)
    victim = running_job(load, [job_id], min_step=24)
    stack.services[sampler_of(stack, victim.worker_id)].kill()
    fault_at = now()
    summary = check(
        "sampler `kill -9` during a long job: resumed from its checkpoint", stack.pg_url, load, fault_at=fault_at
    )
    job = load.get(job_id)
    [resumption] = job.resumptions
    assert resumption.attempt == victim.attempts + 1
    assert [f.worker_id for f in job.failed_attempts] == [victim.worker_id], "the crash cost an attempt"
    # The last step the first attempt reached: what its stream said, or what the
    # database had seen (a step's event can die unsent in the killed process's buffer
    # after its progress row was written).
    killed = max(
        victim.progress.step, steps_before_the_crash([e for events in load.jobs[0].log.events for e in events])
    )
    assert resumption.step <= killed, f"resumed from step {resumption.step}, past the {killed} steps run"
    # What the crash cost: the steps after its last checkpoint, run again.
    run = killed + (steps - resumption.step)
    summary.notes.append(f"{run} steps run for {steps} (killed after step {killed}, resumed from {resumption.step})")
    assert run <= 1.2 * steps, (
        f"{run} steps run for a {steps}-step job (killed at {killed}, resumed at {resumption.step})"
    )


def steps_before_the_crash(events: list[pb.JobEvent]) -> int:
    """The last step the first attempt reported: its progress up to the first status
    that follows it (the job going back to the queue, or on to its next attempt)."""
    last = 0
    for event in events:
        if event.HasField("progress"):
            last = max(last, event.progress.step)
        elif event.HasField("status") and last:
            break
    assert last, "the first attempt reported no progress"
    return last


def test_sampler_drained_with_a_backlog(make) -> None:
    """Over 30 s: two samplers with a backlog each are drained under load, and the shutdown
    grace is waited out on purpose."""
    stack = make(samplers=2, worker_backlog=3, shutdown_grace_s=20.0)
    load = Load.of(stack)
    # Long enough (about 1.5 s each) that the one running is still sampling when the drain begins.
    ids = load.submit(10, width=128, height=128, steps=100)
    draining = sorted(n for n in stack.services if n.startswith("sampler"))[0]
    worker_id = stack.services[draining].env["DARKROOM_WORKER_ID"]

    def held() -> list[pb.Job]:
        return [j for j in map(load.get, ids) if j.worker_id == worker_id and j.status in (2, 3, 4)]

    def sampling(j: pb.Job) -> bool:
        return j.status == pb.JOB_STATUS_RUNNING and 1 <= j.progress.step <= 50

    running = next(
        j.job_id
        for j in wait_for(
            held, lambda jobs: len(jobs) >= 3 and any(map(sampling, jobs)), timeout=60, what="a backlog on the sampler"
        )
        if sampling(j)
    )
    fault_at = now()
    started = time.monotonic()
    stopper = threading.Thread(target=stack.services[draining].stop)
    stopper.start()
    stopper.join(60)
    drain_s = time.monotonic() - started
    summary = check("sampler SIGTERM with a backlog: drain and hand-back", stack.pg_url, load, fault_at=fault_at)
    summary.notes.append(f"SIGTERM to exit: {drain_s:.1f} s")
    assert stack.services[draining].proc is None or stack.services[draining].proc.returncode == 0
    jobs = {j: load.get(j) for j in ids}
    # What it was sampling (the batch of the job seen running) was suspended at a
    # step and resumed elsewhere from there. A job started beside it (the next batch,
    # or one joining at a step boundary) but drained before its first step was
    # suspended at step 0: it starts over elsewhere, with nothing to resume from.
    # The rest ran once.
    suspended = {j: job for j, job in jobs.items() if job.suspensions}
    assert running in suspended and jobs[running].suspensions[0].step > 0
    for job in suspended.values():
        [suspension] = job.suspensions
        assert (suspension.worker_id, suspension.reason) == (worker_id, "drain")
        if suspension.step > 0:
            [resumption] = job.resumptions
            assert resumption.worker_id != worker_id and resumption.step == suspension.step
        else:
            assert not job.resumptions
        assert not job.failed_attempts and job.worker_id != worker_id and job.starts == 2
    rest = [job for j, job in jobs.items() if j not in suspended]
    assert all(j.starts == 1 and not j.failed_attempts for j in rest), "nothing ran twice, nothing counted"
    assert drain_s < 20, f"the drain took {drain_s:.1f}s: it should take about one step, well inside the grace"
    with psycopg.connect(stack.pg_url) as conn:
        assert conn.execute("SELECT status FROM workers WHERE id = %s", (worker_id,)).fetchone() == ("gone",)


def test_sampler_killed_during_a_video_resumes_it_from_its_checkpoint(make, tmp_path: Path) -> None:
    registry = tmp_path / "registry.toml"
    registry.write_text(CHECKPOINTED_MEDIA)
    stack = make(model_registry=str(registry))
    load = Load.of(stack)
    # Long enough that a poll sees it past step 30 before it ends, under a loaded
    # machine too: the tiny network's step is a couple of milliseconds.
    steps = 200
    video: dict[str, Any] = dict(width=96, height=64, steps=steps, model="tiny-wan", frames=17)
    [job_id] = load.submit(1, **video)
    victim = running_job(load, [job_id], min_step=30)
    stack.services[sampler_of(stack, victim.worker_id)].kill()
    fault_at = now()
    summary = check(
        "sampler `kill -9` during a video: resumed from its checkpoint", stack.pg_url, load, fault_at=fault_at
    )
    job = load.get(job_id)
    [resumption] = job.resumptions
    assert 0 < resumption.step <= steps and [f.worker_id for f in job.failed_attempts] == [victim.worker_id]
    killed = steps_before_the_crash([e for events in load.jobs[0].log.events for e in events])
    summary.notes.append(f"killed after step {killed} of {steps}, resumed from {resumption.step}")
    # The video it would have made uninterrupted, byte for byte.
    request = pb.SubmitJobRequest()
    request.CopyFrom(load.jobs[0].request)
    request.idempotency_key += "-again"
    again = wait_terminal(load.stub, load.stub.SubmitJob(request).job_id, timeout=180)
    assert again.status == pb.JOB_STATUS_SUCCEEDED and not again.resumptions
    assert job.images[0].data == again.images[0].data, "the resumed video is the uninterrupted one"


def group_job(stack: LocalStack, group: str) -> tuple[Load, pb.Job]:
    """Two long jobs of a parallel model that checkpoints every 5 steps, and the one
    the group runs, once it is past step 12."""
    load = Load.of(stack)
    ids = load.submit(2, width=128, height=128, steps=60, model="tiny-cfg2")
    victim = first_job(
        load,
        ids,
        lambda j: j.status == pb.JOB_STATUS_RUNNING and j.worker_id == group and j.progress.step >= 12,
        "a job running on the group past step 12",
    )
    return load, victim


def test_a_group_member_killed_then_one_hung_mid_job(make, tmp_path: Path) -> None:
    """Over 30 s: two CPU samplers, a group (``auto``), the only one serving the model
    (a single sampler beside it could take the jobs while the group re-forms). A
    follower of the group is killed (`kill -9`) mid-job, then, once the group has
    re-formed, hangs (SIGSTOP, found by its hang timeout of 5 s) mid-job: each time its
    leader is killed with it (or ends itself, its batch failed) rather than left in a
    collective, the job goes back to the queue once, finishes from its last checkpoint,
    and the group re-forms without the host restarting. One stack for both: its start is most of a scenario's cost."""
    registry = write_registry(tmp_path / "registry.toml", checkpoint_every_steps=5, max_steps=150)
    stack = make(model_registry=str(registry), samplers=2)
    [group] = stack.sampler_ids()
    assert group.endswith("-cpus0-1")
    leader, follower = stack.services["sampler-0"], stack.services["sampler-1"]
    assert follower.env["DARKROOM_GROUP_RANK"] == "1"
    for fault in ("kill", "hang"):
        load, victim = group_job(stack, group)
        led, first = leader.pid, follower.pid
        if fault == "kill":
            follower.kill()
        else:
            follower.signal(signal.SIGSTOP)
        fault_at = now()
        what = "`kill -9`" if fault == "kill" else "`SIGSTOP` (hung)"
        check(f"group member {what} mid-job: resumed from its checkpoint", stack.pg_url, load, fault_at=fault_at)
        job = load.get(victim.job_id)
        assert [f.worker_id for f in job.failed_attempts] == [group], "the broken group cost one attempt"
        [resumption] = job.resumptions
        assert 0 < resumption.step <= 60
        # The leader ends itself once its batch fails (GroupBroken), or is killed with its group first.
        assert leader.last_exit in ("its group broke", f"it exited with code {EXIT_UNFIT}"), leader.last_exit
        assert leader.pid not in (None, led) and follower.pid not in (None, first)
        wait_for(
            functools.partial(worker_state, load, group), lambda state: state == "ready", timeout=60, what="it ready"
        )


def worker_state(load: Load, worker_id: str) -> str | None:
    return {w.worker_id: w.state for w in load.stub.GetStats(pb.GetStatsRequest()).workers}.get(worker_id)
