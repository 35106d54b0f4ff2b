"""A batch member's noise scheduler, kept on the host: its tables and bookkeeping on
the CPU, so that what it decides on is a host number and never a device tensor read
back (on CUDA, a read back empties the GPU's queue for the host); and the noising of
an edit's input image, with ``add_noise``'s coefficients computed on the host."""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch

from gpu_worker.denoising.checkpoint_capture import LoopState
from services.generation import GenerationParams

# The names of the tensors an edit resumes with, besides its latents.
IMAGE_LATENTS = "image_latents"  # its input image, encoded by the VAE
MASK = "mask"  # inpainting: 1 where the model paints, at the latents' size
NOISE = "noise"  # the noise its latents started from

# Where a scheduler's tables and bookkeeping live.
HOST = torch.device("cpu")


# Per pipeline scheduler, per class: an unused scheduler made from its config, which
# each job's is copied from. ``from_config`` inspects signatures and checks
# deprecations every time (0.4 to 0.9 ms a job, on the host, in the job's path); a
# copy of a fresh one is the same state in a fifth of that.
_TEMPLATES: weakref.WeakKeyDictionary[Any, dict[type, Any]] = weakref.WeakKeyDictionary()


def host_scheduler(cls: Any, pipe: Any, params: GenerationParams, **timesteps: Any) -> Any:
    """A new noise scheduler of class ``cls`` (the pipeline's config) set to the job's
    steps (and what else its family sets them with: ``timesteps``), its tables on the
    host."""
    made = _TEMPLATES.setdefault(pipe.scheduler, {})
    template = made.get(cls)
    if template is None:
        template = made[cls] = cls.from_config(pipe.scheduler.config)
    scheduler = copy.deepcopy(template)
    scheduler.set_timesteps(params.steps, device=HOST, **timesteps)
    return scheduler


def size_shift(config: Any, tokens: int, max_shift: float = 1.15) -> float:
    """The flow-matching shift (``mu``) of an image of ``tokens`` latent tokens, linear
    between the scheduler config's base and max: each pipeline's ``calculate_shift``
    (SD 3's defaults its max to 1.16), in the same operations, so the same float."""
    base_len, max_len = config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096)
    base, top = config.get("base_shift", 0.5), config.get("max_shift", max_shift)
    m = (top - base) / (max_len - base_len)
    b = base - m * base_len
    return float(tokens * m + b)


def initial_sigma(scheduler: Any) -> float:
    """What a first step's noise is scaled by: 1 for a flow-matching scheduler, which has none."""
    return float(getattr(scheduler, "init_noise_sigma", 1.0))


def model_input(scheduler: Any, latents: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The latents scaled for the network at ``t``: a flow-matching scheduler does not."""
    scale = getattr(scheduler, "scale_model_input", None)
    return latents if scale is None else scale(latents, t)


def keep_unmasked(state: LoopState, step: int) -> None:
    """Inpainting: outside the mask, the input image noised to the next step."""
    mask = state.extras.get(MASK)
    if mask is None:
        return
    image, noise = state.extras[IMAGE_LATENTS], state.extras[NOISE]
    timesteps = state.scheduler.timesteps
    if step + 1 < len(timesteps):
        keep, add = noising(state.scheduler, timesteps[step + 1 : step + 2], image.dtype)
        image = keep * image + add * noise
    state.latents = (1 - mask) * image + mask * state.latents


def noising(scheduler: Any, t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_noise``'s coefficients at ``t`` (a flow-matching scheduler's ``scale_noise``:
    ``sigma * noise + (1 - sigma) * image``), on the host: it is linear in the image
    and the noise (``keep * image + add * noise``) for every diffusers scheduler, and
    asking it with ones and zeros on the host spares the device a lookup it would
    read back."""
    one, zero = torch.ones(1, dtype=dtype), torch.zeros(1, dtype=dtype)
    if not hasattr(scheduler, "add_noise"):
        # Its sigma is that of its step index (or begin index), as its pipelines ask it.
        keep = scheduler.scale_noise(one, t, zero).reshape(())
        add = scheduler.scale_noise(zero, t, one).reshape(())
        return keep, add
    keep = scheduler.add_noise(one, zero, t).reshape(())
    add = scheduler.add_noise(zero, one, t).reshape(())
    return keep, add


def start_from_input(
    state: LoopState, params: GenerationParams, image: torch.Tensor, mask: torch.Tensor | None, noise: torch.Tensor
) -> int:
    """An edit's latents at its first step: its input ``image`` latents (one per
    output) noised to the step its strength starts at, or, inpainting all of it from
    step 0, the noise alone, as diffusers does; what its steps and its checkpoints
    read of the input goes in its extras. Returns the loop index it starts at."""
    # A second-order scheduler lists each timestep twice: its loop index is twice the step.
    first = params.first_step() * state.scheduler.order
    state.extras = {IMAGE_LATENTS: image, NOISE: noise}
    if mask is not None:
        state.extras[MASK] = mask
    if hasattr(state.scheduler, "set_begin_index"):
        state.scheduler.set_begin_index(first)
    if first == 0 and mask is not None:
        state.latents = noise * initial_sigma(state.scheduler)
    else:
        keep, add = noising(state.scheduler, state.scheduler.timesteps[first : first + 1], noise.dtype)
        state.latents = keep * image + add * noise
    return first
