"""The decoder's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.telemetry.metrics import BATCH_BUCKETS, LATENCY_BUCKETS

DECODER_QUEUED_IMAGES = Gauge("darkroom_decoder_queued_images", "Images this decoder holds: waiting and decoding.")
DECODER_QUEUED_MEGAPIXELS = Gauge(
    "darkroom_decoder_queued_megapixels", "Megapixels of the images this decoder holds: waiting and decoding."
)
DECODE_BATCH_IMAGES = Histogram(
    "darkroom_decode_batch_images", "Images in each VAE call a decoder made.", ["model"], buckets=BATCH_BUCKETS
)
DECODE_SECONDS = Histogram(
    "darkroom_decode_seconds", "How long each batched VAE call took.", ["model"], buckets=LATENCY_BUCKETS
)
PROMPT_ENCODES = Counter(
    "darkroom_decoder_prompt_encodes",
    'Conditionings a decoder returned for EncodePrompt (text_encoders = "service"), by model and whether its '
    'cache held them (cached="true": no encoder ran).',
    ["model", "cached"],
)
TEXT_ENCODER_BYTES = Gauge(
    "darkroom_decoder_text_encoder_bytes", "Bytes of the text encoders a decoder holds on its device, of every model."
)
