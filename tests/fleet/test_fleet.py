"""The fleet on real addresses, broken the way networks break: a GPU host, a
control host and a NATS host cut off while they keep running, the PostgreSQL
primary lost, and every link slow and lossy. Each scenario runs jobs through both
gateways as a client would and ends with the fault suite's checker: every
accepted job ends once, every result intact, nothing run twice, nothing left."""

from __future__ import annotations

import shutil
import time
from datetime import datetime
from pathlib import Path

import pytest

from services.db.states import WorkerStatus
from services.db.worker_records import WorkerRecord
from services.errors import BusError
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from tests.faults.harness import Load, check, now
from tests.fleet.fleet import GROUP_MODEL, SHARDED_MODEL, Fleet
from tests.fleet.model_store import (
    STORE_MODEL,
    announcing,
    cache_dir,
    cached_digests,
    fetched_bytes,
    head_written,
    manifest_digests,
    partial_bytes,
    push_store_model,
    ready_caching,
    sending_to,
    start_store_gpu,
)
from tests.fleet.network import Host
from tests.fleet.probes import gateway_up, round_trip_ms, stage_latencies, stream_replicas_current
from tests.helpers import wait_for

pytestmark = pytest.mark.fleet

# Long enough on a CPU sampler for a cut to land mid-job.
STEPS = 100
# Jobs submitted while a fault lasts: what matters is that they are taken and run once.
SHORT_STEPS = 10
# A host resolving a store model reads its latest version and manifest, once per
# process that loads it (the sampler, and its engine decoding locally).
MANIFEST_READS_PER_HOST = 4
# What the peers may send, in megabits a second: the padding blob takes seconds.
PEER_RATE_MBIT = 40


def running_on(load: Load, ids: list[str], worker_id: str, *, min_step: int = 3) -> pb.Job:
    """The first of ``ids`` seen running on ``worker_id`` past ``min_step``."""
    found = wait_for(
        lambda: next(
            (
                j
                for j in map(load.get, ids)
                if j.worker_id == worker_id and j.status == pb.JOB_STATUS_RUNNING and j.progress.step >= min_step
            ),
            None,
        ),
        lambda j: j is not None,
        timeout=90,
        what=f"a job running on {worker_id}",
    )
    assert found is not None
    return found


def worker_heard(fleet: Fleet, worker_id: str) -> WorkerRecord | None:
    """The worker as presence last heard it; None: never."""
    return next((w for w in fleet.workers_heard() if w.id == worker_id), None)


def back_with_its_outcome_refused(fleet: Fleet, worker_id: str, healed_at: datetime, load: Load, moved: pb.Job) -> None:
    """Back on the network, ``worker_id`` heartbeats again, ready, and what it finished
    while cut off of ``moved`` (a job now another attempt's) was refused."""
    wait_for(
        lambda: worker_heard(fleet, worker_id),
        lambda w: w is not None and w.live and w.status == WorkerStatus.READY and w.last_heartbeat > healed_at,
        timeout=60,
        what=f"{worker_id} heartbeating again",
    )
    again = load.get(moved.job_id)
    assert (again.worker_id, again.attempts, again.images) == (moved.worker_id, moved.attempts, moved.images)


def test_a_gpu_host_cut_off_mid_job(fleet: Fleet) -> None:
    """Its jobs finish on the other GPU host; when it comes back its late writes
    are refused (the job is another attempt's) and it rejoins, serving again.
    Over 30 s: the cut host is noticed only when its heartbeats go stale, and its jobs
    run again elsewhere."""
    cut_host, other = fleet.gpus
    cut_worker = fleet.worker_id(cut_host)
    load = Load(fleet.channel(), patience_s=180)
    ids = load.submit(6, steps=STEPS, width=128, height=128)
    assert all(ids), [f.error for f in load.jobs]
    victim = running_on(load, ids, cut_worker)
    fault_at = now()
    cut_host.cut()
    try:
        load.wait(timeout=180)
    finally:
        cut_host.heal()
        healed_at = now()
    check("fleet: a GPU host cut off mid-job", fleet.pg_url, load, fault_at=fault_at)
    moved = load.get(victim.job_id)
    assert moved.worker_id == fleet.worker_id(other) and moved.attempts >= 2, moved
    # Back on the network, the host's sampler heartbeats again and is given work;
    # what it finished while cut off was refused (the job is another attempt's).
    back_with_its_outcome_refused(fleet, cut_worker, healed_at, load, moved)
    served = Load(fleet.channel())
    served.submit(6, steps=STEPS // 2, width=128, height=128)
    check("fleet: the GPU host back, serving", fleet.pg_url, served)
    workers = {served.get(f.job_id).worker_id for f in served.jobs}
    assert cut_worker in workers, f"nothing ran on {cut_worker} after it came back: {workers}"


def test_a_group_s_host_cut_off_mid_job(fleet: Fleet) -> None:
    """A host of two CPU samplers serving as one group (formed from the registry, as
    ``darkroom supervise`` forms it) is cut off while the group runs a parallel
    model's job: the job finishes on a single sampler of another host from the
    group's last checkpoint; back on the network, the group's late writes are refused
    and it serves again, a model only a group serves.
    Over 30 s: a third GPU host starts (two samplers), and the cut is noticed only when
    the group's heartbeats go stale."""
    host = fleet.group_host
    group = fleet.group_id(host)
    singles = {fleet.worker_id(g) for g in fleet.gpus}
    fleet.start_gpu(host, samplers=2, decoders=0)
    try:
        wait_for(
            lambda: worker_heard(fleet, group),
            lambda w: w is not None and w.live and w.status == WorkerStatus.READY,
            timeout=120,
            what=f"the group {group} ready",
        )
        heard = worker_heard(fleet, group)
        assert heard is not None and heard.telemetry["group"]["members"] == ["cpu0", "cpu1"], heard
        load = Load(fleet.channel(), patience_s=180)
        ids = load.submit(4, steps=STEPS, width=128, height=128, model=GROUP_MODEL)
        assert all(ids), [f.error for f in load.jobs]
        victim = running_on(load, ids, group, min_step=12)  # past its checkpoint at step 10
        fault_at = now()
        host.cut()
        try:
            load.wait(timeout=180)
        finally:
            host.heal()
            healed_at = now()
        check("fleet: a group's host cut off mid-job", fleet.pg_url, load, fault_at=fault_at)
        moved = load.get(victim.job_id)
        assert moved.worker_id in singles and group in [f.worker_id for f in moved.failed_attempts], moved
        [resumption] = moved.resumptions
        assert 0 < resumption.step <= STEPS, resumption
        back_with_its_outcome_refused(fleet, group, healed_at, load, moved)
        served = Load(fleet.channel())
        served.submit(2, steps=SHORT_STEPS, width=128, height=128, model=SHARDED_MODEL)
        check("fleet: the group back, serving", fleet.pg_url, served)
        assert {served.get(f.job_id).worker_id for f in served.jobs} == {group}
    finally:
        fleet.stop_gpu(host)


def test_the_control_host_cut_off(fleet: Fleet) -> None:
    """Samplers finish what they hold; the other control host's scheduler places
    the rest and its gateway answers the clients; the cut one rejoins.
    Over 30 s: a cut host is noticed only when its heartbeats go stale, and rejoins
    after."""
    cut_host = fleet.control[0]
    load = Load(fleet.channel(), patience_s=180)
    load.submit(6, steps=STEPS, width=128, height=128)
    time.sleep(1.0)  # placed and running, some of them, when the host goes
    fault_at = now()
    cut_host.cut()
    try:
        load.submit(4, steps=SHORT_STEPS)  # only the other gateway can take these
        load.wait(timeout=180)
    finally:
        cut_host.heal()
    check("fleet: a control host (gateway and scheduler) cut off", fleet.pg_url, load, fault_at=fault_at)
    # Back: its gateway answers again, and work goes on.
    wait_for(lambda: gateway_up(fleet.gateway_address(cut_host)), bool, timeout=60, what="the cut gateway back")
    after = Load(fleet.channel_to(cut_host))
    after.submit(3, steps=4)
    check("fleet: the control host back", fleet.pg_url, after)


def test_a_nats_host_cut_off_then_healed(fleet: Fleet) -> None:
    """Over 30 s: a NATS node is cut, its cluster re-forms, and it is healed and rejoins."""
    cut_host = fleet.nats[0]
    load = Load(fleet.channel(), patience_s=180)
    load.submit(4, steps=STEPS, width=128, height=128)
    fault_at = now()
    cut_host.cut()
    try:
        load.submit(6, steps=SHORT_STEPS)
        load.wait(timeout=180)
    finally:
        cut_host.heal()
    check("fleet: a NATS host cut off", fleet.pg_url, load, fault_at=fault_at)
    wait_for(
        lambda: stream_replicas_current(fleet), bool, timeout=90, what="every replica of the dispatch stream current"
    )
    after = Load(fleet.channel())
    after.submit(4, steps=4)
    check("fleet: the NATS host back", fleet.pg_url, after)


def test_the_postgres_primary_lost(fleet: Fleet) -> None:
    """The monitor promotes the synchronous standby; every service follows the
    writable server through its multi-host URL; no acknowledged submit is lost.
    Over 30 s: pg_auto_failover's monitor takes tens of seconds to promote the standby,
    by its design."""
    primary = fleet.postgres.primary()
    standby = next(n for n in fleet.postgres.nodes if n is not primary)
    load = Load(fleet.channel(), patience_s=240)
    load.submit(6, steps=STEPS, width=128, height=128)
    fault_at = now()
    primary.host.cut()
    try:
        load.submit(6, steps=SHORT_STEPS)  # acknowledged once the new primary has them
        wait_for(
            lambda: fleet.postgres.state(standby.host.name),
            lambda s: s == "primary" or s.startswith("wait_primary"),
            timeout=120,
            what="the standby promoted",
        )
        promoted_at: datetime = now()
        # The cut one should demote itself first (postgres_ha.py times it so), but its
        # keeper's loop runs late on two loaded cores, and one that never saw its
        # standby leave does not demote at all (once in 60 s after the promotion, in a
        # clean-clone run of the suite): observed, not required. No service reaches it
        # while it is cut off; healed, it must rejoin as the new primary's standby (below).
        old_serves = primary.serves_as_primary()
        load.wait(timeout=240)
    finally:
        primary.host.heal()
    summary = check("fleet: the PostgreSQL primary lost", fleet.pg_url, load, fault_at=fault_at)
    summary.notes.append(
        f"standby promoted {(promoted_at - fault_at).total_seconds():.1f} s after the cut; "
        f"the cut primary {'still served' if old_serves else 'had stopped'} then"
    )
    # The old primary comes back as the new one's standby: replication synchronous again.
    wait_for(
        lambda: (fleet.postgres.state(primary.host.name), fleet.postgres.state(standby.host.name)),
        lambda states: states == ("secondary", "primary"),
        timeout=180,
        what="the old primary back as a standby",
    )


def test_every_link_slow_and_lossy(fleet: Fleet) -> None:
    """50 ms on everything each host sends, and 1 % of it lost: everything still
    works; the added latency of each stage is measured.
    Over 30 s: every stage of a job pays 100 ms round trips and lost packets, on
    purpose."""
    baseline = stage_latencies(Load(fleet.channel()), jobs=8)
    fleet.impair(delay_ms=50, loss_percent=1.0)
    try:
        load = Load(fleet.channel(), patience_s=240)
        slow = stage_latencies(load, jobs=8)
        rtt = round_trip_ms(fleet)
    finally:
        fleet.impair(delay_ms=0, loss_percent=0.0)
    summary = check("fleet: 50 ms and 1 % loss on every link", fleet.pg_url, load)
    added = {stage: slow[stage] - baseline[stage] for stage in baseline}
    summary.notes.append(
        f"round trip between hosts {rtt:.0f} ms; added per stage (median, s): "
        + ", ".join(f"{stage} {seconds:+.3f}" for stage, seconds in added.items())
    )
    assert rtt >= 100, f"the links were not slowed: {rtt:.0f} ms round trip"


# The model store: four GPU hosts with empty caches start the same store model at
# once (the store serves each blob at most once, the rest comes from peers), and a
# peer cut off mid-transfer.


def test_four_gpu_hosts_cold_start_one_model_from_the_store_and_each_other(fleet: Fleet, models_dir: Path) -> None:
    """Over 30 s: four hosts each start a sampler that fetches the model over links held to
    a slow rate."""
    pushed = push_store_model(fleet, models_dir / "tiny")
    hosts = fleet.spare_gpus
    want = {fleet.worker_id(h) for h in hosts}
    for host in hosts:
        shutil.rmtree(cache_dir(fleet.root, host), ignore_errors=True)
    sent_before = fleet.model_store.sent_bytes()
    started = time.monotonic()
    try:
        for host in hosts:
            start_store_gpu(fleet, host)
        try:
            wait_for(
                lambda: ready_caching(fleet, pushed.manifest),
                lambda ids: want <= ids,
                timeout=240,  # under the test's own 300 s: the failure then names who was not ready
                what=f"{', '.join(sorted(want))} ready, {STORE_MODEL} in their caches",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{what_the_hosts_say(fleet, hosts)}") from None
        cold_start_s = time.monotonic() - started
        sent = fleet.model_store.sent_bytes() - sent_before
        fetched = {h.name: fetched_bytes(h) for h in hosts}
        # (a) Each blob served by the store at most once; the manifest read by each host.
        allowance = pushed.blob_bytes + MANIFEST_READS_PER_HOST * len(hosts) * pushed.manifest_bytes
        from_store = sum(f.get("store", 0) for f in fetched.values())
        from_peers = sum(f.get("peer", 0) for f in fetched.values())
        assert sent <= allowance, (
            f"the store sent {sent} bytes for blobs of {pushed.blob_bytes} (and manifests of "
            f"{pushed.manifest_bytes}): a blob served more than once; the hosts fetched {fetched}"
        )
        assert from_store <= pushed.blob_bytes, f"the hosts fetched {from_store} bytes from the store: {fetched}"
        assert from_store + from_peers == len(hosts) * pushed.blob_bytes, fetched
        # (b) Every host's cache holds the manifest's bytes.
        expected = manifest_digests(pushed.manifest)
        for host in hosts:
            assert cached_digests(fleet.root, host, STORE_MODEL, pushed.manifest.version) == expected, host.name
        # (c) Jobs for the model run on them and pass the checker.
        load = Load(fleet.channel())
        load.submit(4, model=STORE_MODEL, steps=4)
        summary = check("fleet: four GPU hosts cold-start one model from the store", fleet.pg_url, load)
        summary.notes.append(
            f"four hosts ready holding it {cold_start_s:.1f} s after they started; the store sent {sent:,} bytes for "
            f"{len(pushed.manifest.blobs())} blobs of {pushed.blob_bytes:,} bytes (a manifest read: "
            f"{pushed.manifest_bytes:,}); the hosts fetched {from_store:,} bytes from the store and {from_peers:,} "
            "from peers"
        )
    finally:
        for host in hosts:
            fleet.stop_gpu(host)


def what_the_hosts_say(fleet: Fleet, hosts: list[Host]) -> str:
    """For a failure's message: what presence hears of every worker, and the end of
    each host's logs (the fleet's root goes with its fixture)."""
    try:
        heard = "\n".join(
            f"{w.id}: {w.status} live={w.live} warm={sorted(w.warm_models)}" for w in fleet.workers_heard()
        )
    except BusError as exc:
        heard = f"presence unread: {exc}"
    tails = []
    for host in hosts:
        own = fleet.root / "hosts" / host.name
        for log in sorted(fleet.logs.glob(f"{host.name}-*.log")) + sorted(own.rglob("*.log")):
            tails.append(f"--- {log.relative_to(fleet.root)} ---\n{log.read_text(errors='replace')[-3000:]}")
    return f"presence:\n{heard}\n" + "\n".join(tails)


def test_a_peer_cut_off_mid_transfer(fleet: Fleet, models_dir: Path) -> None:
    """Every peer holding the model is held to a slow rate, and the one sending a
    blob to a host with an empty cache is cut off mid-transfer: that host finishes
    from another peer or the store, and loads the manifest's bytes, nothing corrupt.
    Over 30 s: the peers' links are held to 40 Mbit/s so that the cut lands mid-
    transfer."""
    pushed = push_store_model(fleet, models_dir / "tiny")
    padding, size = pushed.padding_digest, pushed.manifest.blobs()[pushed.padding_digest]
    first, fresh = fleet.spare_gpus[0], fleet.spare_gpus[-1]
    shutil.rmtree(cache_dir(fleet.root, fresh), ignore_errors=True)
    try:
        start_store_gpu(fleet, first)  # a cache hit after the cold start; fetched whole otherwise
        wait_for(
            lambda: ready_caching(fleet, pushed.manifest),
            lambda ids: fleet.worker_id(first) in ids,
            timeout=300,
            what=f"{first.name} ready, {STORE_MODEL} in its cache",
        )
        # The GPU hosts the scheduler gave the model's jobs to hold it too: all are slowed.
        holders = announcing(fleet, padding)
        assert first in holders, [h.name for h in holders]
        before = fleet.model_store.sent_bytes()
        for host in holders:
            host.limit_rate(PEER_RATE_MBIT)
        start_store_gpu(fleet, fresh)
        at_cut = wait_for(
            lambda: partial_bytes(fleet.root, fresh).get(padding, 0),
            lambda n: 0 < n < size,
            timeout=180,
            what=f"{fresh.name} fetching the padding blob from a peer",
        )
        wait_for(
            lambda: head_written(fleet.root, fresh, padding),
            bool,
            timeout=60,
            what=f"{fresh.name} holding the padding blob's first bytes",
        )
        peer = wait_for(lambda: sending_to(holders, fresh), bool, timeout=30, what=f"the peer sending to {fresh.name}")
        assert peer is not None
        fault_at = now()
        peer.cut()
        try:
            wait_for(
                lambda: ready_caching(fleet, pushed.manifest),
                lambda ids: fleet.worker_id(fresh) in ids,
                timeout=300,
                what=f"{fresh.name} ready, {STORE_MODEL} in its cache",
            )
            loaded_s = (now() - fault_at).total_seconds()
            fetched = fetched_bytes(fresh)
            sent = fleet.model_store.sent_bytes() - before
        finally:
            peer.heal()
            for host in holders:
                host.limit_rate(0)
        # The cut peer was sending (bytes in flight to the host, above), and what the
        # host kept of peers' bytes is counted: the transfer was cut, not avoided.
        assert fetched.get("peer", 0) > 0, fetched
        expected = manifest_digests(pushed.manifest)
        assert cached_digests(fleet.root, fresh, STORE_MODEL, pushed.manifest.version) == expected
        load = Load(fleet.channel())
        load.submit(2, model=STORE_MODEL, steps=4)
        summary = check("fleet: a peer cut off mid-transfer", fleet.pg_url, load, fault_at=fault_at)
        summary.notes.append(
            f"{peer.name} (of {len(holders)} peers holding it, each held to {PEER_RATE_MBIT} Mbit/s) cut with "
            f"{at_cut / 1e6:.1f} of {size / 1e6:.1f} MB of a blob reached; {fresh.name} held the model "
            f"{loaded_s:.1f} s after the cut, having fetched {fetched.get('peer', 0) / 1e6:.1f} MB from peers and "
            f"{fetched.get('store', 0) / 1e6:.1f} MB from the store (the store sent {sent / 1e6:.1f} MB)"
        )
    finally:
        fleet.stop_gpu(fresh)
        fleet.stop_gpu(first)
