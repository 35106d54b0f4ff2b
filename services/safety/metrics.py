"""The image filter's Prometheus metrics: in the shared kernel, because the decoder
service and a sampler decoding its own latents both filter (and count) outputs."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from services.telemetry.metrics import LATENCY_BUCKETS

OUTPUTS_FLAGGED = Counter(
    "darkroom_outputs_flagged",
    "Outputs the image filter flagged, by category (open_nsfw's one: sexual) and verdict: flagged (returned as "
    "made), blurred, blocked.",
    ["category", "verdict"],
)
IMAGE_FILTER_SECONDS = Histogram(
    "darkroom_image_filter_seconds",
    "How long each call of the image filter's classifier took (one batch of outputs, on the CPU).",
    buckets=LATENCY_BUCKETS,
)
IMAGE_FILTER_IMAGES = Counter(
    "darkroom_image_filter_images", "Images (a video's sampled frames each) the image filter's classifier scored."
)
