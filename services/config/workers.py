"""The workers' settings: a sampler's (``gpu_worker/``), a decoder's
(``vae_worker/``), and how either decodes latents into pixels."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from services.config.fields import Codec, Section, setting


@dataclass(frozen=True)
class SigningKeyFile:
    """An Ed25519 private key read from a file, passed on by its path."""

    path: Path
    key: Ed25519PrivateKey = field(compare=False, repr=False)


def _signing_key(raw: str) -> SigningKeyFile | None:
    if not raw.strip():
        return None
    path = Path(raw).expanduser()
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read it ({exc.strerror})") from None
    try:
        key = load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise ValueError("not an unencrypted PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"not an Ed25519 private key ({type(key).__name__})")
    return SigningKeyFile(path, key)


def _signing_key_from_toml(value: object) -> SigningKeyFile | None:
    if not isinstance(value, str):
        raise ValueError("expected a string")
    return _signing_key(value)


SIGNING_KEY = Codec(
    "path of an Ed25519 private key (PEM)",
    _signing_key,
    _signing_key_from_toml,
    lambda v: str(v.path) if v is not None else "",
)


@dataclass(frozen=True)
class DecodeSettings(Section):
    """How latents become pixels: the decoder's, and a sampler's local fallback."""

    tile_above_pixels: int = setting(
        1536 * 1536,
        "Images of more pixels decode in overlapping tiles, so that memory stays that of a tile.",
        env="DECODE_TILE_ABOVE_PIXELS",
        at_least=1,
    )
    min_pixel_std: float = setting(
        0.002,
        "Decoded images whose pixels (0..1) vary less than this (standard deviation) are degenerate: the decode "
        "fails, for another decoder to try.",
        env="DECODE_MIN_PIXEL_STD",
        at_least=0.0,
    )


@dataclass(frozen=True)
class GroupSettings(Section):
    """A sampler's place in a group of samplers that serve one parallel replica
    together (docs/parallel.md): set by the supervisor that forms the group."""

    size: int = setting(1, "Samplers in its group; 1: it serves alone.", env="GROUP_SIZE", at_least=1, at_most=8)
    rank: int = setting(
        0,
        "Its rank in the group: 0 leads (dispatch, database, heartbeat); the rest follow.",
        env="GROUP_RANK",
        at_least=0,
        at_most=7,
    )
    address: str = setting(
        "127.0.0.1:0",
        "HOST:PORT where the group's ranks meet (the leader's; a fresh port each formation).",
        env="GROUP_ADDRESS",
    )
    epoch: int = setting(
        0, "Which formation of the group this is (each restart takes a new one).", env="GROUP_EPOCH", at_least=0
    )
    members: tuple[str, ...] = setting(
        (), "Its members' devices in rank order (the leader's heartbeat reports them).", env="GROUP_MEMBERS"
    )
    stall_after_s: float = setting(
        300.0,
        "The leader exits (its supervisor re-forms the group) when a batch across the group reaches no step "
        "boundary for this long, or for ten of its slowest steps if longer: a rank stuck inside a collective. "
        "Longer than a compilation of a new shape mid-batch takes (each rank compiles at its own pace).",
        env="GROUP_STALL_AFTER_S",
        at_least=1.0,
    )


@dataclass(frozen=True)
class SamplerSettings(Section):
    """A sampler: one process per GPU (``gpu_worker/``)."""

    worker_id: str = setting("", "Its id; empty: host and GPU, so a restarted sampler takes back its own subject.")
    host: str = setting(
        "127.0.0.1", "Where its gRPC server listens (and the address it registers).", env="SAMPLER_HOST"
    )
    port: int = setting(0, "Its gRPC port; 0 picks a free one.", env="SAMPLER_PORT", at_least=0)
    device: str = setting("", 'cuda, cuda:0, cpu, or empty for "cuda if available, else cpu".')
    preload_models: tuple[str, ...] = setting(
        (),
        "Models pinned to it: loaded and warmed up with one real generation before it reports ready, evicted last "
        "(`darkroom up`: the builtin ones).",
    )
    memory_budget_mb: int = setting(
        0,
        "Memory its models may take (MiB); 0: the GPU's own, less 15 % for activations, unlimited on a CPU.",
        at_least=0,
    )
    capabilities: tuple[str, ...] = setting(
        (),
        "The kinds of work it serves, of its models' capabilities (image, video, upscale): e.g. `image` keeps "
        "video off a small card. Empty: every capability of the models that fit its memory.",
    )
    batch_wait_ms: float = setting(
        0.0,
        "How long it waits, holding a partial batch, for more jobs of its shape before the batch starts; it always "
        "waits for the jobs the same scheduling pass sent it, so 0 batches what was queued together and delays "
        "nothing else. A job of a running batch's model and size never waits: it joins at the next step.",
        at_least=0.0,
    )
    continuous_batching: bool = setting(
        True,
        "A running batch takes jobs of its model and size (any steps, guidance, seed) in at its step boundaries, and "
        "each member leaves when its own steps are done; false: a batch runs as it started (batch-at-start), and its "
        "heartbeat offers no open seats.",
    )
    prompt_cache_mb: int = setting(64, "Prompt embeddings it keeps (MiB), least recently used first out.", at_least=0)
    local_decode_fallback: bool = setting(False, "It decodes its own latents when no decoder service can.")
    decode_locally: bool = setting(
        False,
        "It decodes its own latents (and encodes edits' inputs) on its own device, never calling a decoder service: "
        "for a box whose decoder would share the sampler's GPU. One process, one CUDA context, batched like the "
        "decoder's, on a lower-priority CUDA stream than its denoising.",
    )
    dispatch_ack_wait_s: float = setting(
        30.0, "JetStream redelivers a dispatch not acked (or kept in progress) this long.", at_least=1.0
    )
    dispatch_max_ack_pending: int = setting(64, "Dispatches it may hold unacked.", at_least=1)
    outcome_retry_s: float = setting(
        30.0,
        "How long it retries storing a job's outcome before leaving the dispatch unacked, for redelivery.",
        at_least=0.0,
    )
    unhealthy_after_failures: int = setting(
        3,
        "Failed attempts in a row after which it reports unhealthy and exits, for its supervisor to restart it.",
        at_least=1,
    )
    compile_signing_key: SigningKeyFile | None = setting(
        None,
        "A file holding the samplers' Ed25519 private key (PEM), the same on every sampler of a fleet: a sampler "
        "signs the record of each compiled artifact it shares through the model store with it, and loads only "
        "artifacts whose record it verifies (docs/security.md). Empty: it neither loads nor shares the fleet's "
        "compiled artifacts, and compiles for itself. `darkroom up` with a model store makes one in "
        "DATA_DIR/secrets.",
        env="COMPILE_SIGNING_KEY_FILE",
        codec=SIGNING_KEY,
    )
    decode: DecodeSettings = setting(doc="Its local fallback decode.", factory=DecodeSettings)
    group: GroupSettings = setting(
        doc="Its group, where it serves a parallel replica with others.", factory=GroupSettings
    )


@dataclass(frozen=True)
class DecoderSettings(Section):
    """A decoder (``vae_worker/``): latents in, encoded images out."""

    worker_id: str = setting("", "Its id; empty: host and port.")
    host: str = setting(
        "127.0.0.1", "Where its gRPC server listens (and the address it registers).", env="DECODER_HOST"
    )
    port: int = setting(0, "Its gRPC port; 0 picks a free one.", env="DECODER_PORT", at_least=0)
    device: str = setting("", 'cuda, cuda:0, cpu, or empty for "cuda if available, else cpu".')
    preload_models: tuple[str, ...] = setting((), "Models whose VAE it loads at start.")
    batch_wait_ms: float = setting(
        0.0,
        "How long it gathers concurrent requests of one model and latent shape into one VAE call (a sampler's batch "
        "is one request; under load requests gather anyway while the previous batch runs).",
        env="DECODE_BATCH_WAIT_MS",
        at_least=0.0,
    )
    max_batch: int = setting(8, "Images in one VAE call at most.", env="DECODE_MAX_BATCH", at_least=1)
    prompt_cache_mb: int = setting(
        256,
        'Conditionings it encoded for models whose text encoders it serves (text_encoders = "service"), kept by '
        "prompt (MiB), least recently used first out.",
        env="DECODER_PROMPT_CACHE_MB",
        at_least=0,
    )
    decode: DecodeSettings = setting(doc="How it decodes.", factory=DecodeSettings)
