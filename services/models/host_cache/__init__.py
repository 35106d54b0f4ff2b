"""The model cache on one GPU host's disk, shared by the host's samplers: blobs by
digest (verified before they are kept), each model version's directory of hard
links to them, one download per host (file locks), bounded by bytes with
least-recently-used eviction of versions no sampler holds. Blobs come from peers
(other hosts' caches, over the mesh) before the object store."""

from services.models.host_cache.cache import HeldModel, HostCache
from services.models.host_cache.sources import BlobSource, BlobSourceFailed

__all__ = ["BlobSource", "BlobSourceFailed", "HeldModel", "HostCache"]
