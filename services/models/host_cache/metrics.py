"""The host cache's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter

FETCHED_BYTES = Counter(
    "darkroom_model_cache_fetched_bytes",
    "Bytes of model blobs a host's cache fetched, by source: peer (another host's cache) or store.",
    ["source"],
)
LOOKUPS = Counter(
    "darkroom_model_cache_lookups",
    "Model versions resolved from a host's cache, by result: hit (complete already) or miss (fetched).",
    ["result"],
)
EVICTIONS = Counter("darkroom_model_cache_evictions", "Model versions evicted from a host's cache to make room.")
CORRUPT_BLOBS = Counter(
    "darkroom_model_cache_corrupt_blobs",
    "Blobs that failed their SHA-256 check and were fetched again, by source (cache: found corrupt on disk).",
    ["source"],
)
PEER_BYTES_SERVED = Counter(
    "darkroom_model_cache_peer_served_bytes", "Bytes of blobs this sampler served to other hosts' caches."
)
