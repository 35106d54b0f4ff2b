"""The model store's origin leases against a real nats-server: two hosts after one
blob, one takes the lease and reads the store, the other waits and fetches from
it once it announces the blob; a lease its holder let go or left to expire is
taken over; and a sealed NATS lets a sampler's user do all of it."""

from __future__ import annotations

import asyncio
import collections
import hashlib
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.bus.connection import connect_nats
from services.bus.credentials import NatsCredentials
from services.errors import ModelError
from services.mesh.nats_auth import CONTROL_USERS, sampler_user
from services.mesh.pki import ROLES
from services.mesh.secrets import ensure_certificates
from services.models.host_cache import origin
from services.models.host_cache.blobs import ensure_blob
from services.models.host_cache.fleet import FleetSources
from services.models.host_cache.layout import Layout
from services.models.host_cache.origin import Lease, OriginLeases
from services.models.host_cache.sources import BlobSource, BlobSourceFailed, StoreSource
from services.ops.embedded_nats import EmbeddedNats

pytestmark = [pytest.mark.integration, pytest.mark.quick]

DIGEST = "ab" * 32
OTHER = "cd" * 32


async def leases_of(url: str, *hosts: str) -> AsyncIterator[list[OriginLeases]]:
    connections = [await connect_nats([url], name=f"test-{host}") for host in hosts]
    try:
        yield [
            await OriginLeases.open(nc.jetstream(timeout=2), host) for nc, host in zip(connections, hosts, strict=True)
        ]
    finally:
        for nc in connections:
            await nc.close()


@pytest.fixture
async def two_hosts(nats_server: EmbeddedNats) -> AsyncIterator[list[OriginLeases]]:
    async for leases in leases_of(nats_server.url, "host-a", "host-b"):
        yield leases


async def test_one_host_takes_the_lease_and_the_other_sees_it_held_then_done(two_hosts: list[OriginLeases]) -> None:
    a, b = two_hosts
    revision = await a.take(DIGEST)
    assert revision is not None
    assert await b.take(DIGEST) is None  # create is atomic: one holder
    assert await b.read(DIGEST) == Lease("host-a", done=False)
    async with a.holding(DIGEST, revision) as claim:
        claim.verified = True
    assert await b.read(DIGEST) == Lease("host-a", done=True)
    assert await b.take(DIGEST) is None


async def test_a_failed_fetch_lets_the_lease_go_and_another_host_takes_it(two_hosts: list[OriginLeases]) -> None:
    a, b = two_hosts
    revision = await a.take(OTHER)
    assert revision is not None
    with pytest.raises(RuntimeError):
        async with a.holding(OTHER, revision):
            raise RuntimeError("cut off")
    assert await b.read(OTHER) is None
    assert await b.take(OTHER) is not None
    assert await a.read(OTHER) == Lease("host-b", done=False)


async def test_a_lease_left_by_a_dead_holder_expires_and_is_taken(
    nats_server: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(origin, "LEASE_S", 1.0)  # the bucket's TTL, as it is made
    async for a, b in leases_of(nats_server.url, "host-a", "host-b"):
        assert await a.take(DIGEST) is not None  # and never refreshed: its holder died
        assert await b.take(DIGEST) is None
        deadline = time.monotonic() + 15
        while await b.read(DIGEST) is not None:
            assert time.monotonic() < deadline, "the lease never expired"
            await asyncio.sleep(0.2)
        assert await b.take(DIGEST) is not None


class CountingStore:
    """Stands in for the object store's reads: writes the blob, counting each read."""

    def __init__(self, data: bytes) -> None:
        self.data, self.reads = data, 0

    async def read_blob(self, digest: str, size: int, dest_fd: int, *, offset: int = 0) -> None:
        self.reads += 1
        await asyncio.sleep(0.3)  # long enough for the other host to find the lease held
        os.pwrite(dest_fd, self.data[offset:], offset)


class AnnouncedPeer(BlobSource):
    kind = "peer"

    def __init__(self, data: bytes, served: list[str]) -> None:
        self.data, self.served = data, served

    async def fetch(self, digest: str, size: int, dest_fd: int, offset: int) -> None:
        self.served.append(digest)
        os.pwrite(dest_fd, self.data[offset:], offset)


async def test_bytes_that_fail_their_check_let_the_lease_go_not_mark_it_done(
    two_hosts: list[OriginLeases], tmp_path: Path
) -> None:
    """The lease holder's store read gave rotten bytes: it never announces the blob,
    so the lease must not say it will; another host takes it at once, not after
    waiting out its patience."""
    a, b = two_hosts
    data = os.urandom(4096)
    digest = hashlib.sha256(data).hexdigest()
    rotten = CountingStore(b"\0" * len(data))
    chain = FleetSources(
        rotten,
        peer_source=lambda address: AnnouncedPeer(data, []),
        peers_of=lambda d: [],
        leases=a,
        host=a.host,
        patience_s=1.0,
        poll_s=0.05,
    )
    layout = Layout(tmp_path / "host-a")
    layout.make()
    with pytest.raises(ModelError, match="no source could give it"):
        await ensure_blob(layout, digest, len(data), chain, collections.Counter())
    assert rotten.reads == 2  # once under the lease, once more under it taken again
    assert await b.read(digest) is None
    assert await b.take(digest) is not None


async def _first_that_gives(sources: FleetSources, digest: str, size: int, fd: int) -> str:
    async for source in sources(digest, size):
        try:
            await source.fetch(digest, size, fd, 0)
        except BlobSourceFailed:
            continue
        return source.kind
    raise AssertionError("no source gave the blob")


async def test_the_waiting_host_fetches_from_the_lease_holder_once_it_announces(
    two_hosts: list[OriginLeases], tmp_path: Path
) -> None:
    a, b = two_hosts
    data = os.urandom(4096)
    store = CountingStore(data)
    announced: set[str] = set()
    served: list[str] = []

    def sources(leases: OriginLeases, peers: list[str]) -> FleetSources:
        chain = FleetSources(
            store,
            peer_source=lambda address: AnnouncedPeer(data, served),
            peers_of=lambda digest: peers if digest in announced else [],
            leases=leases,
            host=leases.host,
            poll_s=0.05,
        )
        assert isinstance(chain.store, StoreSource)
        return chain

    digest = "ef" * 32
    fds = [os.open(tmp_path / name, os.O_RDWR | os.O_CREAT) for name in ("a", "b")]
    try:
        host_a = asyncio.create_task(_first_that_gives(sources(a, []), digest, len(data), fds[0]))
        deadline = time.monotonic() + 10
        while await b.read(digest) is None:  # host A holds the lease before host B asks
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        host_b = asyncio.create_task(_first_that_gives(sources(b, ["host-a:1"]), digest, len(data), fds[1]))
        assert await host_a == "store"
        assert not host_b.done()  # waiting: the lease is done, no peer announces it yet
        announced.add(digest)  # host A's samplers announce it in their heartbeats
        assert await asyncio.wait_for(host_b, 10) == "peer"
    finally:
        for fd in fds:
            os.close(fd)
    assert store.reads == 1
    assert served == [digest]
    assert (tmp_path / "b").read_bytes() == data


async def test_a_sealed_nats_lets_a_samplers_user_take_and_release_leases(tmp_path: Path) -> None:
    mesh_dir = tmp_path / "mesh"
    ensure_certificates(mesh_dir, hosts=["127.0.0.1", "localhost"], roles=ROLES)
    users = [sampler_user("gpu-a"), sampler_user("gpu-b")]
    server = EmbeddedNats(tmp_path / "nats", mesh_dir=mesh_dir, users=[*CONTROL_USERS, *users])
    server.start()
    connections = []
    try:
        for user in users:
            credentials = NatsCredentials.of(mesh_dir, "sampler", user)
            connections.append(
                await connect_nats([f"tls://127.0.0.1:{server.port}"], name=user, credentials=credentials)
            )
        # A refused request times out: 2 s, not the default's 5, per step.
        a = await OriginLeases.open(connections[0].jetstream(timeout=2), "host-a")  # makes the bucket
        b = await OriginLeases.open(connections[1].jetstream(timeout=2), "host-b")  # binds to it
        revision = await a.take(DIGEST)
        assert revision is not None
        assert await b.take(DIGEST) is None
        assert await b.read(DIGEST) == Lease("host-a", done=False)
        async with a.holding(DIGEST, revision) as claim:
            claim.verified = True
        assert await b.read(DIGEST) == Lease("host-a", done=True)
        taken = await b.take(OTHER)
        assert taken is not None
        with pytest.raises(RuntimeError):
            async with b.holding(OTHER, taken):
                raise RuntimeError("cut off")
        assert await a.read(OTHER) is None  # b's delete went through
    finally:
        for nc in connections:
            await nc.close()
        server.stop()
