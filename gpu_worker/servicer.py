"""The sampler's gRPC server: the scheduler suspends the jobs it samples, the gateway
cancels them, and (with a model store) other hosts' samplers read the blobs of its
host's model cache."""

from __future__ import annotations

import grpc

from gpu_worker.jobs.tracker import JobTracker, StopReason
from gpu_worker.models.model_store import SamplerModelStore
from services.config.workers import SamplerSettings
from services.mesh.rpc import MeshIdentity
from services.models.host_cache import peers
from services.rpc.gen.darkroom.internal.v1 import sampler_pb2, sampler_pb2_grpc
from services.rpc.server import Server, build_server
from services.rpc.status import unary_errors


class SamplerServicer(sampler_pb2_grpc.SamplerServicer):
    def __init__(self, tracker: JobTracker) -> None:
        self.tracker = tracker

    @unary_errors
    async def CancelJob(
        self, request: sampler_pb2.SamplerCancelRequest, context: grpc.aio.ServicerContext
    ) -> sampler_pb2.SamplerCancelResponse:
        watch = self.tracker.get(request.job_id)
        if watch is None or watch.finished_at is not None:
            return sampler_pb2.SamplerCancelResponse(was_running=False)
        watch.stop(StopReason.CANCELLED)
        return sampler_pb2.SamplerCancelResponse(was_running=True)

    @unary_errors
    async def SuspendJob(
        self, request: sampler_pb2.SamplerSuspendRequest, context: grpc.aio.ServicerContext
    ) -> sampler_pb2.SamplerSuspendResponse:
        watch = self.tracker.get(request.job_id)
        if watch is None or watch.attempt != request.attempt or watch.finished_at is not None or watch.sampled:
            return sampler_pb2.SamplerSuspendResponse(was_running=False)
        watch.stop(StopReason.PREEMPTED, request.reason or "preempted")
        return sampler_pb2.SamplerSuspendResponse(was_running=True)


# Who may call a sampler, where the mesh is sealed: the scheduler suspends, the
# gateway cancels, other hosts' samplers read the blobs of its host's model cache.
SAMPLER_CALLERS = {"darkroom.internal.v1.Sampler": frozenset({"scheduler", "gateway"}), **peers.BLOB_CACHE_CALLERS}


def create_server(
    settings: SamplerSettings,
    tracker: JobTracker,
    mesh: MeshIdentity | None = None,
    model_store: SamplerModelStore | None = None,
) -> Server:
    """The Sampler gRPC server (not started); port 0 picks a free port. With a
    model store, it serves its host cache's blobs to peers too."""
    servicer = SamplerServicer(tracker)
    blobs = [peers.add_to_server(model_store.cache.layout)] if model_store is not None else []
    return build_server(
        [
            (lambda s: sampler_pb2_grpc.add_SamplerServicer_to_server(servicer, s), "darkroom.internal.v1.Sampler"),
            *blobs,
        ],
        settings.host,
        settings.port,
        mesh=mesh,
        roles=SAMPLER_CALLERS,
    )
