"""The sealed mesh, tried from outside through the real processes of a stack as
`darkroom up` runs it: callers without a certificate of the fleet's CA, or with
one of the wrong role, at a sampler and at a decoder; NATS without credentials,
and a sampler's credentials reaching for another sampler's dispatches or the
stream itself, or speaking for another sampler's job to its stream; PostgreSQL
without its password."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from dataclasses import replace
from pathlib import Path

import grpc
import nats
import psycopg
import pytest
from nats.js.api import ConsumerConfig
from nats.js.errors import NotFoundError

from services.bus.credentials import NatsCredentials, inbox_prefix
from services.bus.dispatch import DISPATCH_STREAM, consumer_name, dispatch_subject
from services.bus.presence_board import BUCKET as PRESENCE_BUCKET
from services.bus.presence_board import STREAM as PRESENCE_STREAM
from services.bus.presence_board import SUBJECT_PREFIX as PRESENCE_PREFIX
from services.bus.presence_board import Announcement, PresenceBoard, plan_key, worker_key
from services.db.states import WorkerKind, WorkerStatus
from services.db.worker_records import WorkerHeartbeat
from services.mesh.nats_auth import sampler_user
from services.mesh.pki import CertificateAuthority, CertPaths
from services.mesh.secrets import nats_password_path, password
from services.ops.embedded import EmbeddedPostgres
from services.ops.stack import LocalStack
from services.presence_read import read_once
from services.rpc.gen.darkroom.internal.v1 import sampler_pb2, sampler_pb2_grpc, vae_decoder_pb2, vae_decoder_pb2_grpc
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc
from tests.helpers import nats_as_operator, workers_heard

pytestmark = pytest.mark.integration

DENIED_WITHIN_S = 1.0


def worker_address(stack: LocalStack, kind: str) -> str:
    ready = [w for w in workers_heard(stack.settings.kernel).values() if w.kind == kind and w.status == "ready"]
    assert ready, f"no ready {kind}"
    return ready[0].address


def mesh_dir(stack: LocalStack) -> Path:
    return Path(stack.settings.kernel.mesh_dir)


def as_role(stack: LocalStack, role: str, directory: Path | None = None) -> grpc.ChannelCredentials:
    ca, cert, key = CertPaths.of(directory or mesh_dir(stack), role).read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def suspend(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    request = sampler_pb2.SamplerSuspendRequest(job_id="no-such-job", attempt=1, reason="test")
    with grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address) as ch:
        try:
            sampler_pb2_grpc.SamplerStub(ch).SuspendJob(request, timeout=5)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[attr-defined, no-any-return]
    return grpc.StatusCode.OK


def decode(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    with grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address) as ch:
        try:
            list(vae_decoder_pb2_grpc.VaeDecoderStub(ch).Decode(vae_decoder_pb2.DecodeRequest(), timeout=5))
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[attr-defined, no-any-return]
    return grpc.StatusCode.OK


def test_a_sampler_takes_suspends_only_from_the_scheduler_and_the_gateway(stack: LocalStack) -> None:
    address = worker_address(stack, "sampler")
    assert suspend(address, as_role(stack, "scheduler")) == grpc.StatusCode.OK
    assert suspend(address, as_role(stack, "gateway")) == grpc.StatusCode.OK
    assert suspend(address, as_role(stack, "decoder")) == grpc.StatusCode.PERMISSION_DENIED
    assert suspend(address, as_role(stack, "sampler")) == grpc.StatusCode.PERMISSION_DENIED
    # No certificate: the handshake fails before any method.
    assert suspend(address, None) == grpc.StatusCode.UNAVAILABLE
    ca, _, _ = CertPaths.of(mesh_dir(stack), "scheduler").read()
    assert suspend(address, grpc.ssl_channel_credentials(root_certificates=ca)) == grpc.StatusCode.UNAVAILABLE


def test_a_sampler_refuses_a_certificate_of_another_ca(stack: LocalStack, tmp_path: Path) -> None:
    stranger = CertificateAuthority.create()
    stranger.issue_into(tmp_path, "scheduler", ["127.0.0.1"])
    theirs = CertPaths.of(tmp_path, "scheduler")
    # The stranger trusts the fleet's server, but the server does not trust the stranger.
    ca = CertPaths.of(mesh_dir(stack), "scheduler").ca.read_bytes()
    credentials = grpc.ssl_channel_credentials(ca, theirs.key.read_bytes(), theirs.cert.read_bytes())
    assert suspend(worker_address(stack, "sampler"), credentials) == grpc.StatusCode.UNAVAILABLE


def test_a_decoder_decodes_only_for_samplers(stack: LocalStack) -> None:
    address = worker_address(stack, "decoder")
    # Past the role check, an empty request is the decoder's to refuse.
    assert decode(address, as_role(stack, "sampler")) == grpc.StatusCode.INVALID_ARGUMENT
    for role in ("scheduler", "gateway", "decoder"):
        assert decode(address, as_role(stack, role)) == grpc.StatusCode.PERMISSION_DENIED, role
    assert decode(address, None) == grpc.StatusCode.UNAVAILABLE


async def connect(stack: LocalStack, **options: object) -> nats.NATS:
    return await nats.connect(
        stack.settings.kernel.nats_servers,
        allow_reconnect=False,
        connect_timeout=2,
        max_reconnect_attempts=0,
        **options,
    )


def sampler_credentials(stack: LocalStack, worker_id: str) -> NatsCredentials:
    credentials = NatsCredentials.of(stack.settings.kernel.mesh_dir, "sampler", sampler_user(worker_id))
    assert credentials is not None
    return credentials


async def test_nats_takes_no_one_without_credentials(stack: LocalStack) -> None:
    with pytest.raises((nats.errors.Error, OSError, ssl.SSLError)):
        await connect(stack)  # plaintext
    operator = sampler_credentials(stack, stack.sampler_ids()[0]).tls
    with pytest.raises(nats.errors.Error, match=r"[Aa]uthorization"):
        await connect(stack, tls=operator)  # the fleet's certificate, but no user
    with pytest.raises(nats.errors.Error, match=r"[Aa]uthorization"):
        await connect(stack, tls=operator, user="scheduler", password="guessed")
    # A user's password without a certificate of the fleet's CA: the TLS handshake fails.
    context = ssl.create_default_context(cafile=str(CertPaths.of(mesh_dir(stack), "nats").ca))
    user = "scheduler"
    secret = password(nats_password_path(mesh_dir(stack), user))
    with pytest.raises((nats.errors.Error, OSError, ssl.SSLError)):
        await connect(stack, tls=context, user=user, password=secret)


@pytest.fixture(scope="module")
def intruder(stack: LocalStack) -> str:
    """A sampler NATS knows, with credentials of its own, that is not the stack's."""
    assert stack.nats is not None
    stack.nats.set_users([*stack.nats.users, sampler_user("intruder")])
    return "intruder"


async def as_sampler(stack: LocalStack, worker_id: str) -> nats.NATS:
    credentials = sampler_credentials(stack, worker_id)
    for _ in range(50):  # the reload that added the user takes a moment
        try:
            return await connect(
                stack,
                tls=credentials.tls,
                user=credentials.user,
                password=credentials.password,
                inbox_prefix=credentials.inbox_prefix,
            )
        except nats.errors.Error:
            await asyncio.sleep(0.1)
    raise AssertionError("the intruder's user was never let in")


async def test_a_sampler_consumes_only_its_own_subject(stack: LocalStack, intruder: str) -> None:
    [victim] = stack.sampler_ids()
    nc = await as_sampler(stack, intruder)
    operator = await nats_as_operator(stack.settings.kernel)
    try:
        js = nc.jetstream(timeout=DENIED_WITHIN_S)
        # Its own consumer, on its own subject: allowed.
        own = ConsumerConfig(
            name=consumer_name(intruder),
            durable_name=consumer_name(intruder),
            filter_subject=dispatch_subject(intruder),
        )
        await js.add_consumer(DISPATCH_STREAM, own)
        # Another sampler's consumer, or one of its own on another's subject: refused.
        for name, subject in ((consumer_name(victim), dispatch_subject(victim)), (consumer_name(intruder), ">")):
            theirs = ConsumerConfig(name=name, durable_name=name, filter_subject=subject)
            with pytest.raises(nats.errors.TimeoutError):
                await js.add_consumer(DISPATCH_STREAM, theirs)
        info = await operator.jetstream().consumer_info(DISPATCH_STREAM, consumer_name(intruder))
        assert info.config.filter_subject == dispatch_subject(intruder)
        # Pulling from the victim's consumer, reading the stream's messages, or
        # subscribing to its subject or another's inbox: refused.
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request(
                f"$JS.API.CONSUMER.MSG.NEXT.{DISPATCH_STREAM}.{consumer_name(victim)}",
                b'{"batch": 1, "no_wait": true}',
                timeout=DENIED_WITHIN_S,
            )
        with pytest.raises(nats.errors.TimeoutError):
            await js.get_msg(DISPATCH_STREAM, seq=1)
        errors: list[Exception] = []

        async def refused(exc: Exception) -> None:
            errors.append(exc)

        spy = await nats.connect(
            stack.settings.kernel.nats_servers,
            tls=sampler_credentials(stack, intruder).tls,
            user=sampler_user(intruder),
            password=sampler_credentials(stack, intruder).password,
            inbox_prefix=inbox_prefix(sampler_user(intruder)),
            error_cb=refused,
            allow_reconnect=False,
        )
        try:
            await spy.subscribe(dispatch_subject(victim))
            await spy.subscribe(f"{inbox_prefix(sampler_user(victim))}.>")
            await spy.flush()
            # The server answers each refused subscription with an error of its own.
            for _ in range(50):
                if len(errors) >= 2:
                    break
                await asyncio.sleep(0.1)
            assert sorted(str(e).lower() for e in errors) == [
                f'nats: permissions violation for subscription to "{inbox_prefix(sampler_user(victim))}.>"'.lower(),
                f'nats: permissions violation for subscription to "{dispatch_subject(victim)}"'.lower(),
            ]
        finally:
            await spy.close()
    finally:
        await nc.close()
        await operator.jetstream().delete_consumer(DISPATCH_STREAM, consumer_name(intruder))
        await operator.close()


async def test_a_sampler_cannot_dispatch_or_touch_the_stream(stack: LocalStack, intruder: str) -> None:
    [victim] = stack.sampler_ids()
    nc = await as_sampler(stack, intruder)
    operator = await nats_as_operator(stack.settings.kernel)
    try:
        before = (await operator.jetstream().stream_info(DISPATCH_STREAM)).state.messages
        js = nc.jetstream(timeout=DENIED_WITHIN_S)
        for subject in (dispatch_subject(victim), dispatch_subject(intruder)):
            with pytest.raises(nats.errors.TimeoutError):
                await js.publish(subject, b'{"job_id": "forged", "attempt": 1}', stream=DISPATCH_STREAM)
        with pytest.raises(nats.errors.TimeoutError):
            await js.delete_stream(DISPATCH_STREAM)
        with pytest.raises(nats.errors.TimeoutError):
            await js.purge_stream(DISPATCH_STREAM)
        info = await operator.jetstream().stream_info(DISPATCH_STREAM)
        assert info.state.messages == before
        with pytest.raises(NotFoundError):
            await operator.jetstream().consumer_info(DISPATCH_STREAM, "never-made")
    finally:
        await nc.close()
        await operator.close()


async def test_a_sampler_announces_only_itself_and_reads_only_its_own_plan(stack: LocalStack, intruder: str) -> None:
    [victim] = stack.sampler_ids()
    nc = await as_sampler(stack, intruder)
    operator = await nats_as_operator(stack.settings.kernel)
    try:
        js = nc.jetstream(timeout=DENIED_WITHIN_S)
        board = PresenceBoard(await js.key_value(PRESENCE_BUCKET))
        forged = Announcement(
            WorkerHeartbeat(victim, WorkerKind.SAMPLER, "10.6.6.6:1", "cpu", ("tiny",), ()), "forged", 0.0
        )
        # Its own key: allowed. The victim's, a decoder's, or a warm plan: refused.
        # (As starting: the scheduler must not place the stack's jobs on it.)
        mine = replace(forged.heartbeat, id=intruder, status=WorkerStatus.STARTING)
        await board.announce(Announcement(mine, "intruder-1", 0.0))
        for key in (worker_key(WorkerKind.SAMPLER, victim), worker_key(WorkerKind.DECODER, "d"), plan_key(intruder)):
            with pytest.raises(nats.errors.TimeoutError):
                await board.kv.put(key, forged.encode())
        assert await board.plan(intruder) is None  # its own plan: readable (none stored)
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request(
                f"$JS.API.DIRECT.GET.{PRESENCE_STREAM}.{PRESENCE_PREFIX}.{plan_key(victim)}",
                b"",
                timeout=DENIED_WITHIN_S,
            )
        victims = {w.id: w for w in await read_once(operator, stale_after_s=60)}
        assert victims[victim].address != "10.6.6.6:1"
        assert victims[intruder].address == "10.6.6.6:1"
    finally:
        await nc.close()
        await (await operator.jetstream().key_value(PRESENCE_BUCKET)).purge(worker_key(WorkerKind.SAMPLER, intruder))
        await operator.close()


def test_postgres_takes_no_one_without_its_password(postgres: EmbeddedPostgres) -> None:
    socket = {"host": str(postgres.socket_dir), "port": postgres.port, "user": "postgres", "dbname": "postgres"}
    with pytest.raises(psycopg.OperationalError, match=r"no password supplied|password authentication failed"):
        psycopg.connect(**socket, connect_timeout=2)  # type: ignore[arg-type]
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(**socket, password="guessed", connect_timeout=2)  # type: ignore[arg-type]
    # No TCP port at all: the server listens on its socket only.
    with pytest.raises(psycopg.OperationalError, match=r"refused|could not connect"):
        psycopg.connect(host="127.0.0.1", port=postgres.port, user="postgres", password="x", connect_timeout=2)
    # With the password (the services' URL): in.
    with psycopg.connect(postgres.url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("postgres",)


FORGED_TOTAL = 999_999
FORGED_PREVIEW = b"forged preview"


def forgeries(attempt: int) -> list[bytes]:
    """What a sampler that does not hold a job might say of it: a step, a preview, its
    end, and a next attempt's start and step."""
    preview = base64.b64encode(FORGED_PREVIEW).decode()
    return [
        json.dumps(body).encode()
        for body in (
            {"attempt": attempt, "step": FORGED_TOTAL - 1, "total": FORGED_TOTAL},
            {"attempt": attempt, "step": 1, "total": FORGED_TOTAL, "preview": preview, "index": 0, "size": [8, 8]},
            {"attempt": attempt, "status": "FAILED"},
            {"attempt": attempt + 1, "status": "RUNNING"},
            {"attempt": attempt + 1, "step": FORGED_TOTAL - 1, "total": FORGED_TOTAL},
        )
    ]


def holder_of(stack: LocalStack, job_id: str) -> tuple[int, str | None]:
    with psycopg.connect(stack.pg_url) as conn:
        row = conn.execute("SELECT attempt, worker_id FROM jobs WHERE id = %s", (job_id,)).fetchone()
    assert row is not None
    return int(row[0]), row[1]


async def test_a_stream_shows_only_what_the_holder_of_its_attempt_publishes(stack: LocalStack, intruder: str) -> None:
    """A sampler with NATS credentials of its own publishes steps, previews and statuses
    into another sampler's running job: under its own name (all NATS lets it use),
    under the holder's, the scheduler's or a gateway's, or under none. The job's
    stream shows none of it; the holder's own steps and previews still come."""
    [victim] = stack.sampler_ids()
    steps = 100
    async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
        client = image_generation_pb2_grpc.ImageGenerationStub(channel)
        request = pb.SubmitJobRequest(
            model="tiny", prompt="held", width=128, height=128, steps=steps, previews=3, seed=7, lane="paid"
        )  # the paid lane's outputs leave as made ("flag"): its jobs may have previews
        job_id = (await client.SubmitJob(request)).job_id
        forging = asyncio.Event()
        seen: list[tuple[bool, pb.JobEvent]] = []  # (heard after forging began, the event)

        async def watch() -> None:
            async for event in client.StreamJob(pb.StreamJobRequest(job_id=job_id), timeout=120):
                seen.append((forging.is_set(), event))

        watching = asyncio.create_task(watch())
        for _ in range(600):
            if any(e.HasField("progress") for _, e in seen) or watching.done():
                break
            await asyncio.sleep(0.05)
        attempt, worker = holder_of(stack, job_id)
        assert worker == victim and not watching.done()
        errors: list[Exception] = []

        async def refused(exc: Exception) -> None:
            errors.append(exc)

        credentials = sampler_credentials(stack, intruder)
        nc = await nats.connect(
            stack.settings.kernel.nats_servers,
            tls=credentials.tls,
            user=credentials.user,
            password=credentials.password,
            inbox_prefix=credentials.inbox_prefix,
            error_cb=refused,
            allow_reconnect=False,
        )
        subject = f"darkroom.job.{job_id}"
        names = ("", sampler_user(intruder), sampler_user(victim), "scheduler", "gateway")
        subjects = [f"{subject}.{name}" if name else subject for name in names]
        try:
            forging.set()
            while not watching.done():
                for forged in subjects:
                    for body in forgeries(attempt):
                        await nc.publish(forged, body)
                await nc.flush()
                await asyncio.sleep(0.05)
        finally:
            await nc.close()
        await watching
    events = [e for _, e in seen]
    progress = [(after, e.progress) for after, e in seen if e.HasField("progress")]
    previews = [(after, e.preview) for after, e in seen if e.HasField("preview")]
    statuses = [e.status for e in events if e.HasField("status")]
    # Nothing forged reached the client ...
    assert all(p.total == steps for _, p in progress), [p for _, p in progress if p.total != steps]
    assert all(p.data != FORGED_PREVIEW and p.data[:2] == b"\xff\xd8" for _, p in previews)
    assert pb.JOB_STATUS_FAILED not in statuses and statuses[-1] == pb.JOB_STATUS_SUCCEEDED
    assert events[-1].terminal.status == pb.JOB_STATUS_SUCCEEDED
    # ... and the holder's own steps and previews still did, while the forgeries went on.
    assert [p.step for after, p in progress if after][-1] == steps
    assert any(after for after, _ in previews)
    # NATS refused every name but the intruder's own.
    refusals = {str(e).lower() for e in errors}
    for forged in subjects:
        violation = f'nats: permissions violation for publish to "{forged}"'.lower()
        assert (violation in refusals) == (forged != f"{subject}.{sampler_user(intruder)}"), forged
