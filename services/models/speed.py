"""Speed options of a model's networks, applied alike by the sampler (its denoising
network), the decoder (its VAE) and the GPU benchmark's bare loop, so that each
option is measured against the same thing.

- ``optimize``: every option below that keeps images within tolerance on the device
  (on CUDA: compile with CUDA graphs, channels-last, fused QKV, cuDNN attention on
  Hopper and later, flash attention before; on a CPU: compile, channels-last, fused
  QKV). Quantization stays an opt-in of its own: it moves images.
- ``compile``: ``torch.compile`` of the network's repeated blocks, each compiled once
  and shared by every block of its class and shapes (regional compilation, as
  diffusers' ``compile_repeated_blocks``: ``REGIONS``); a network with no known
  regions is compiled whole. Batches are padded to buckets (1, 2, 4, ... up to the
  model's batch size) and each bucket is run once as the model loads, so that no
  user's job waits for a compilation at the model's default size (a new size compiles
  once, when first met). A network a group shards (``parallel.tensor``) has the
  ``forward`` of each sharded block compiled, the gathering of its weights left eager.
- ``cuda_graphs``: compiled with CUDA graphs (``mode="reduce-overhead"``): a step is
  replayed, not launched kernel by kernel; a network output is copied out of the
  graph's memory before the next replay overwrites it.
- ``channels_last``: the channels-last memory format, which the convolutions of
  tensor cores prefer.
- ``attention``: "flash", "efficient" or "cudnn" prefers that SDPA kernel (falling
  back to the others where it cannot run); "sdpa" and "eager" pick the UNet's
  attention processor.
- ``fuse_qkv``: each attention's query, key and value projections as one matmul
  (where that keeps the outputs: ``fuses_exactly``; never for a model that takes
  adapters, which adapt each projection alone).
- ``quantize``: the network's linear weights quantized by torchao: "int8"
  (weight-only), "fp8" (activations and weights, for Hopper's FP8 tensor cores).
- ``step_cache``: a step reuses a job's last prediction while its estimated change
  stays within this threshold (``gpu_worker.denoising.step_cache``).

``optimize = "aggressive"`` adds to ``optimize``'s the options that move images a
little for speed (``bench/step_cache.py`` and ``bench/gpu.py`` report how far): step
caching (the model's threshold, or ``AGGRESSIVE_STEP_CACHE``) and, where the device
has FP8 tensor cores and the model asks for no other quantization, "fp8"."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from services.models.device import forget_dtype
from services.models.spec import ModelSpec

log = logging.getLogger(__name__)

# The options ``optimize`` leaves to the model's own choice when it names one.
_SDPA_KERNELS = ("flash", "efficient", "cudnn")
# The step-caching threshold ``optimize = "aggressive"`` uses where the model names
# none (bench/step_cache.py: on the miniature at 20 steps, about a third of the
# steps reused; see docs/benchmarks.md for the images' drift).
AGGRESSIVE_STEP_CACHE = 0.1
# Distinct shapes a compiled network may see before torch recompiles no more (its
# default, 8, is below buckets times guidance on and off times a few sizes).
RECOMPILE_LIMIT = 64
# The backend of ``torch.compile``: inductor generates kernels; tests on a CPU swap
# in "aot_eager", which traces the same graphs without generating code.
COMPILE_BACKEND = "inductor"
# The blocks compiled one by one (regional compilation), by the network's class, where
# the class does not list its own (diffusers' ``_repeated_blocks``): most of the
# network's time is in them, and one compilation serves every block of a class and
# shape. None of them holds another, so no compiled block is traced into another's graph.
REGIONS: dict[str, tuple[str, ...]] = {
    "UNet2DConditionModel": ("BasicTransformerBlock", "ResnetBlock2D"),
    "SD3Transformer2DModel": ("JointTransformerBlock",),
    "Decoder": ("ResnetBlock2D",),  # an image VAE's decoder
}


@dataclass(frozen=True)
class SpeedOptions:
    compile: bool = False
    cuda_graphs: bool = False
    channels_last: bool = False
    attention: str = ""
    fuse_qkv: bool = False
    quantize: str = ""
    step_cache: float = 0.0

    @classmethod
    def of(cls, spec: ModelSpec, device: torch.device) -> SpeedOptions:
        """The options ``spec`` asks for on ``device``, ``optimize`` spelled out."""
        cuda = device.type == "cuda"
        graphs = cuda and not spec.parallel.grouped  # no graph can capture a group's collectives
        whole = spec.parallel.tensor == 1  # sharded weights are not fused, re-laid out or quantized
        # Adapters adapt the query, key and value projections one by one: fused into
        # one matmul, none of theirs would apply.
        fuse = not spec.adapter_slots and whole
        if not spec.optimize:
            chosen = spec.cuda_graphs and graphs
            fused = spec.fuse_qkv and fuse
            return cls(spec.compile, chosen, spec.channels_last, spec.attention, fused, spec.quantize, spec.step_cache)
        attention = spec.attention
        if not attention and cuda:
            attention = "cudnn" if torch.cuda.get_device_capability(device) >= (9, 0) else "flash"
        if spec.optimize != "aggressive":
            return cls(True, graphs, whole, attention, fuse, spec.quantize, spec.step_cache)
        fp8 = cuda and whole and torch.cuda.get_device_capability(device) >= (8, 9)
        quantized = spec.quantize or ("fp8" if fp8 else "")
        return cls(True, graphs, whole, attention, fuse, quantized, spec.step_cache or AGGRESSIVE_STEP_CACHE)

    @property
    def any(self) -> bool:
        return self != SpeedOptions()

    def describe(self) -> str:
        on = [name for name in ("compile", "cuda_graphs", "channels_last", "fuse_qkv") if getattr(self, name)]
        on += [f"attention={self.attention}"] if self.attention else []
        on += [f"quantize={self.quantize}"] if self.quantize else []
        on += [f"step_cache={self.step_cache:g}"] if self.step_cache else []
        return ", ".join(on) or "none"


def prepare(module: Any, options: SpeedOptions) -> Any:
    """``module`` (a diffusers network, in inference) with the options applied: the
    module itself, or its compiled wrapper (which forwards attributes to it)."""
    forget_dtype(module)  # quantizing casts it in place
    if options.fuse_qkv and hasattr(module, "fuse_qkv_projections") and fuses_exactly(module):
        module.fuse_qkv_projections()
    if options.channels_last:
        module.to(memory_format=torch.channels_last)
    if options.quantize:
        quantize(module, options.quantize)
    if not options.compile:
        return module
    _raise_recompile_limit()
    mode = "reduce-overhead" if options.cuda_graphs else None
    if compile_shards(module, mode=mode) or compile_regions(module, mode=mode):
        return module
    return torch.compile(module, fullgraph=True, mode=mode, backend=COMPILE_BACKEND)


def compile_shards(module: Any, *, mode: str | None = None) -> int:
    """Compiles in place the ``forward`` of each of ``module``'s blocks a group shards
    by blocks (FSDP2); how many (0: none). The gathering and freeing of their weights
    stay eager around them: dynamo does not trace FSDP2's hooks."""
    from torch.distributed.fsdp import FSDPModule

    compiled = 0
    for block in module.modules():
        if isinstance(block, FSDPModule) and block is not module:
            sharded: Any = block  # FSDP2 mixes its class into the block's own
            sharded.forward = torch.compile(sharded.forward, fullgraph=True, mode=mode, backend=COMPILE_BACKEND)
            compiled += 1
    return compiled


def regions(module: Any) -> tuple[str, ...]:
    """The classes of ``module``'s blocks compiled one by one (``REGIONS``)."""
    own = tuple(getattr(module, "_repeated_blocks", None) or ())
    return tuple(dict.fromkeys((*own, *REGIONS.get(type(module).__name__, ()))))


def compile_regions(module: Any, *, mode: str | None = None, dynamic: bool | None = None) -> int:
    """Compiles each of ``module``'s blocks of its ``regions`` in place (the rest stays
    eager); how many it compiled (0: it has no known regions)."""
    names = regions(module)
    compiled = 0
    for block in module.modules() if names else ():
        if type(block).__name__ in names:
            block.compile(fullgraph=True, dynamic=dynamic, mode=mode, backend=COMPILE_BACKEND)
            compiled += 1
    return compiled


def compile_repeated_blocks(module: Any, options: SpeedOptions) -> None:
    """Compiles each of ``module``'s repeated blocks in place (diffusers' regional
    compilation), their shapes symbolic: for a network whose sequence is as long as
    its prompt (Z-Image), which compiled whole would compile again for each length."""
    _raise_recompile_limit()
    mode = "reduce-overhead" if options.cuda_graphs else None
    compile_regions(module, mode=mode, dynamic=True)


def fuses_exactly(module: Any) -> bool:
    """Whether ``fuse_qkv_projections`` keeps the network's outputs and is used: not
    for SD 3.5's MMDiT, whose QK norms diffusers' fused joint-attention processor
    skips and whose dual (self-)attention it cannot run, nor for Qwen-Image's, whose
    processor reads the unfused projections only (fusing would add a copy of their
    weights, gigabytes, and run none of it); they stay unfused."""
    name = type(module).__name__
    if name == "QwenImageTransformer2DModel":
        return False
    config = getattr(module, "config", None)
    if name != "SD3Transformer2DModel" or config is None:
        return True
    return not (config.get("qk_norm") or config.get("dual_attention_layers"))


def prepare_unet(unet: Any, options: SpeedOptions) -> Any:
    """A UNet with the options: ``prepare``'s, and "sdpa" or "eager" as its attention
    processor (the other families keep their own processors)."""
    if options.attention in ("sdpa", "eager"):
        from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

        unet.set_attn_processor(AttnProcessor2_0() if options.attention == "sdpa" else AttnProcessor())
    return prepare(unet, options)


def prepare_vae(vae: Any, options: SpeedOptions) -> None:
    """An image VAE with the options, in place: no quantization (its few linear
    weights gain nothing, and its pixels would move); where compiled, its decoder."""
    options = replace(options, quantize="")
    prepare(vae, replace(options, compile=False))
    if options.compile:
        vae.decoder = prepare(vae.decoder, replace(options, fuse_qkv=False, channels_last=False))


def quantize(module: Any, kind: str) -> None:
    """The module's linear weights quantized in place by torchao. FP8 activations
    need FP8 tensor cores (compute capability 8.9 and later); elsewhere only the
    weights are stored in FP8."""
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Float8WeightOnlyConfig,
        Int8WeightOnlyConfig,
        quantize_,
    )

    config: Callable[[], Any] = Int8WeightOnlyConfig
    if kind == "fp8":
        device = next(module.parameters()).device
        fp8_cores = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
        config = Float8DynamicActivationFloat8WeightConfig if fp8_cores else Float8WeightOnlyConfig
    quantize_(module, config())


def _raise_recompile_limit() -> None:
    import torch._dynamo

    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # renamed across releases
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), RECOMPILE_LIMIT))


def buckets(max_rows: int) -> list[int]:
    """The batch sizes a compiled network is warmed up for and padded to."""
    sizes = [1]
    while sizes[-1] * 2 < max_rows:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] < max_rows:
        sizes.append(max_rows)
    return sizes


def bucket(rows: int, max_rows: int) -> int:
    """The smallest bucket that holds ``rows`` (``rows`` itself above them all)."""
    return next((size for size in buckets(max_rows) if size >= rows), rows)


def padded(x: torch.Tensor, max_rows: int, options: SpeedOptions) -> torch.Tensor:
    """``x`` with rows of zeros up to its bucket where the network is compiled: the
    network then sees only the shapes it was warmed up with."""
    padding = bucket(len(x), max_rows) - len(x) if options.compile else 0
    return torch.cat([x, x.new_zeros((padding, *x.shape[1:]))]) if padding else x


@contextlib.contextmanager
def network_call(options: SpeedOptions) -> Iterator[None]:
    """Around one call of a network prepared with ``options``: its attention kernel
    preferred, and a new CUDA-graph step marked."""
    if options.cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()
    if options.attention not in _SDPA_KERNELS:
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    preferred = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
    }[options.attention]
    fallbacks = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel([preferred, *[b for b in fallbacks if b != preferred]], set_priority=True):
        yield


def owned(output: torch.Tensor, options: SpeedOptions) -> torch.Tensor:
    """A network's output that the next call cannot overwrite: a CUDA graph's outputs
    live in its memory pool until the next replay."""
    return output.clone() if options.cuda_graphs else output


def latent_drift(got: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> float:
    """How far latents moved from a reference's: the root mean square of their
    difference over the reference's, all of them together (0: identical)."""
    diff = sum(float((g.double() - r.double()).pow(2).sum()) for g, r in zip(got, reference, strict=True))
    norm = sum(float(r.double().pow(2).sum()) for r in reference)
    return (diff / norm) ** 0.5 if norm else 0.0
