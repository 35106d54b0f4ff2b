"""Peers: each sampler serves its host cache's complete blobs to other hosts
(``BlobCache.ReadBlob``, over the sealed mesh), and a host asks the peers that
announce a blob (presence: ``model_cache`` in a sampler's heartbeat telemetry)
before the object store."""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from services import reported
from services.db.states import WorkerKind
from services.db.worker_records import WorkerRecord
from services.errors import ModelError
from services.models.host_cache.layout import Layout
from services.models.host_cache.metrics import PEER_BYTES_SERVED
from services.models.host_cache.sources import BlobSource, BlobSourceFailed
from services.rpc.gen.darkroom.internal.v1 import sampler_pb2, sampler_pb2_grpc
from services.rpc.server import Channels

log = logging.getLogger(__name__)

CHUNK_BYTES = 2**20
# A fetch from a peer reads ranges of a blob on several streams at once: one
# stream's TLS and protobuf work leave a peer's link and cores idle (here, with
# mutual TLS on loopback: 97 MB/s on one stream, 220 MB/s on eight).
PEER_STREAMS = 8
PEER_RANGE_BYTES = 16 * 2**20
# A peer that sends nothing for this long is given up (the fetch resumes elsewhere).
PEER_IDLE_S = 10.0
# A peer that sends, but slower than this on average past its first PEER_IDLE_S, is
# given up too: a trickle never trips the idle limit. Low, so that a slow home link
# is not left for a store that may be slower still (DARKROOM_MODEL_PEER_MIN_MBPS).
PEER_MIN_BYTES_PER_S = 1e6
SERVICE = "darkroom.internal.v1.BlobCache"
# In a sealed mesh only samplers (other hosts' caches) may read blobs.
BLOB_CACHE_CALLERS = {SERVICE: frozenset({"sampler"})}


class BlobCacheServicer(sampler_pb2_grpc.BlobCacheServicer):
    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    async def ReadBlob(
        self, request: sampler_pb2.ReadBlobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[sampler_pb2.BlobChunk]:
        try:
            path = self.layout.blob(request.digest)
        except ModelError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            fd = os.open(path, os.O_RDONLY)  # only ``blobs/``: complete and verified
        except FileNotFoundError:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"blob {request.digest} is not in this host's cache")
        try:
            size = os.fstat(fd).st_size
            if request.offset > size:
                await context.abort(grpc.StatusCode.OUT_OF_RANGE, f"offset {request.offset} is past {size}")
            position = request.offset
            end = min(size, request.offset + request.length) if request.length else size
            while position < end:
                data = await asyncio.to_thread(os.pread, fd, min(CHUNK_BYTES, end - position), position)
                if not data:
                    break
                position += len(data)
                PEER_BYTES_SERVED.inc(len(data))
                yield sampler_pb2.BlobChunk(data=data)
        finally:
            os.close(fd)


def add_to_server(layout: Layout) -> tuple[Callable[[grpc.aio.Server], None], str]:
    """A registration for ``services.rpc.server.build_server``."""
    servicer = BlobCacheServicer(layout)
    return (lambda s: sampler_pb2_grpc.add_BlobCacheServicer_to_server(servicer, s), SERVICE)


class PeerSource(BlobSource):
    """One peer's cache, read as ranges on ``streams`` streams at once, each written
    where it belongs, given up if it idles for ``idle_s`` or falls under
    ``min_bytes_per_s`` (``rate_deadline``). A failure cuts the file back to the
    bytes contiguous from the start, counted to the byte: the ranges complete in
    order, then as far as the first unfinished one got (a resumed fetch goes on
    from there)."""

    kind = "peer"

    def __init__(
        self,
        address: str,
        channels: Channels,
        *,
        idle_s: float = PEER_IDLE_S,
        min_bytes_per_s: float = PEER_MIN_BYTES_PER_S,
        streams: int = PEER_STREAMS,
        range_bytes: int = PEER_RANGE_BYTES,
    ) -> None:
        self.address = address
        self.channels = channels
        self.idle_s = idle_s
        self.min_bytes_per_s = min_bytes_per_s
        self.streams = streams
        self.range_bytes = range_bytes

    async def fetch(self, digest: str, size: int, dest_fd: int, offset: int) -> None:
        stub = sampler_pb2_grpc.BlobCacheStub(self.channels.to(self.address))
        ranges = [(start, min(start + self.range_bytes, size)) for start in range(offset, size, self.range_bytes)]
        todo = iter(ranges)
        reached = {start: start for start, _ in ranges}  # each range's bytes written so far
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def stream() -> None:
            for start, end in todo:
                await self._read_range(stub, digest, start, end, dest_fd, reached, paced)

        def paced() -> None:
            if pace.expired():  # bytes that land after the deadline fired cannot move it back
                return
            gained = sum(reached[start] - start for start, _ in ranges)
            pace.reschedule(rate_deadline(started, gained, grace_s=self.idle_s, min_bytes_per_s=self.min_bytes_per_s))

        try:
            async with asyncio.timeout(None) as pace:
                paced()
                async with asyncio.TaskGroup() as group:  # one failure cancels the rest
                    for _ in range(min(self.streams, len(ranges))):
                        group.create_task(stream())
        except BaseException as exc:
            kept = contiguous(ranges, reached, offset)
            os.ftruncate(dest_fd, kept)
            if isinstance(exc, TimeoutError):
                gained = sum(reached[start] - start for start, _ in ranges)
                raise BlobSourceFailed(
                    f"peer {self.address} gave {gained} bytes in {loop.time() - started:.1f}s, under the minimum "
                    f"{self.min_bytes_per_s / 1e6:g} MB/s"
                ) from None
            if isinstance(exc, BaseExceptionGroup):
                raise exc.exceptions[0] from None  # the first failure; the rest are of the same cause
            raise

    async def _read_range(
        self,
        stub: sampler_pb2_grpc.BlobCacheStub,
        digest: str,
        start: int,
        end: int,
        dest_fd: int,
        reached: dict[int, int],
        on_bytes: Callable[[], None],
    ) -> None:
        call = stub.ReadBlob(sampler_pb2.ReadBlobRequest(digest=digest, offset=start, length=end - start))
        position = start
        try:
            stream = aiter(call)
            while position < end:
                try:
                    chunk = await asyncio.wait_for(anext(stream), self.idle_s)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    raise BlobSourceFailed(f"peer {self.address} sent nothing for {self.idle_s:.0f}s") from None
                if position + len(chunk.data) > end:
                    raise BlobSourceFailed(f"peer {self.address} sent more than bytes {start}-{end} of the blob")
                await asyncio.to_thread(_pwrite_all, dest_fd, chunk.data, position)
                position += len(chunk.data)
                reached[start] = position
                on_bytes()
        except grpc.aio.AioRpcError as exc:
            raise BlobSourceFailed(f"peer {self.address}: {exc.code().name}: {exc.details()}") from exc
        finally:
            call.cancel()
        if position < end:
            raise BlobSourceFailed(f"peer {self.address} ended bytes {start}-{end} of the blob at {position}")


def rate_deadline(started: float, gained: int, *, grace_s: float, min_bytes_per_s: float) -> float | None:
    """When a fetch that began at ``started`` and has ``gained`` bytes falls under
    ``min_bytes_per_s`` on average past its first ``grace_s``, if nothing more
    comes; None: no minimum."""
    if min_bytes_per_s <= 0:
        return None
    return started + grace_s + gained / min_bytes_per_s


def contiguous(ranges: Sequence[tuple[int, int]], reached: Mapping[int, int], offset: int) -> int:
    """How far the bytes run unbroken from ``offset``: each range in order, as far as
    it got, stopping at the first one not finished."""
    complete = offset
    for start, end in ranges:
        complete = reached.get(start, start)
        if complete < end:
            break
    return complete


def _pwrite_all(fd: int, data: bytes, position: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, position)
        view, position = view[written:], position + written


@dataclass(frozen=True)
class CacheAnnouncement:
    """What a sampler's heartbeat says of its host's cache (telemetry ``model_cache``)."""

    host: str
    blobs: frozenset[str]

    def telemetry(self) -> dict[str, Any]:
        return {"model_cache": {"host": self.host, "blobs": sorted(self.blobs)}}

    @classmethod
    def of(cls, worker: WorkerRecord) -> CacheAnnouncement | None:
        body = worker.telemetry.get("model_cache")
        if not isinstance(body, dict) or not isinstance(body.get("host"), str):
            return None
        return cls(body["host"], frozenset(reported.texts(body, "blobs")))


def holders(workers: Sequence[WorkerRecord], digest: str, own_host: str) -> list[WorkerRecord]:
    """The live samplers of other hosts that announce ``digest``: one per host (its
    samplers share one cache), the least busy first, ties shuffled so that hosts
    fetching at once spread over them."""
    by_host: dict[str, WorkerRecord] = {}
    for worker in workers:
        announced = CacheAnnouncement.of(worker)
        if worker.kind != WorkerKind.SAMPLER or not worker.live or announced is None:
            continue
        if announced.host == own_host or digest not in announced.blobs or not worker.address:
            continue
        by_host.setdefault(announced.host, worker)
    found = list(by_host.values())
    random.shuffle(found)
    return sorted(found, key=lambda w: reported.count(w.telemetry, "inflight"))
