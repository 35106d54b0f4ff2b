"""Qwen-Image (``QwenImagePipeline``): a Qwen2.5-VL's last hidden states as the
prompt's embeddings (of a length that varies with the prompt), a dual-stream MMDiT
over latents packed in 2x2 patches, (N, H/16 * W/16, 64), and a flow-matching Euler
noise scheduler shifted by the image's size, in
``gpu_worker.denoising.diffusers_denoiser``'s loop.

Its guidance is true classifier-free guidance: a guided step predicts with the
prompt and with the negative prompt (a space where a job gives none, as Qwen-Image's
own examples do), and their combination is scaled back to the norm of the prompt's
prediction, token by token. The two texts differ in length: on a CPU each half is a
network call of its own, as the pipeline makes them, the only way a job's latents
are exactly the pipeline's; on an accelerator the halves and the members share one
call, each text padded to the longest and masked. A compiled network takes every
text padded to the longest prompt, so that no prompt's length compiles it again.

A member's latents stay packed through its steps and checkpoints, and leave as the
decoder's VAE takes them, (N, 16, H/8, W/8): its frame axis is the decoder's to add.

Qwen-Image-Edit (``QwenImageEditDenoiser``) is the same loop with its input image
beside it twice: its Qwen2.5-VL sees the image with the instruction (and with the
negative prompt), so a job's conditioning is its prompt's and its image's; and the
image's packed latents are more tokens after the denoised ones."""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpu_worker.denoising.diffusers_denoiser import DiffusersDenoiser
from gpu_worker.denoising.diffusers_run import DiffusersRun
from gpu_worker.denoising.members import BatchMember, MemberInputs, no_input_image
from gpu_worker.denoising.noise_schedulers import IMAGE_LATENTS, size_shift
from gpu_worker.denoising.parallel_network import sequence_degree
from gpu_worker.denoising.prompts import Conditioning, prompt_key, text_length
from services.generation import GenerationParams
from services.models import speed
from services.models.device import module_dtype
from services.models.input_limits import edit_condition_size
from services.models.prompt_encoding import QWEN_EDIT_TEXT_LEN as EDIT_TEXT_LEN  # an edit's longest text
from services.models.prompt_encoding import QWEN_TEXT_LEN as TEXT_LEN  # the longest prompt, in tokens
from services.models.sources import resolve_source
from services.models.spec import ModelSpec


class QwenImageDenoiser(DiffusersDenoiser):
    network_name = "transformer"
    compiled_text_len = TEXT_LEN  # the length a compiled network takes every text padded to

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Where members share calls, a guided step's halves share one too, masked.
        self.halves_share_call = self.fuse_batches
        self._compiled: weakref.WeakSet[Any] = weakref.WeakSet()  # networks that take fixed-length text

    def latent_shape(self, pipe: Any, params: GenerationParams) -> tuple[int, ...]:
        h, w = self._grid(pipe, params)
        return (params.num_images, h * w, pipe.transformer.config.in_channels)

    def image_tokens(self, pipe: Any, params: GenerationParams) -> int:
        h, w = self._grid(pipe, params)
        return h * w

    def timestep_args(self, pipe: Any, params: GenerationParams) -> dict[str, Any]:
        h, w = self._grid(pipe, params)
        mu = size_shift(pipe.scheduler.config, h * w)
        return {"sigmas": np.linspace(1.0, 1 / params.steps, params.steps), "mu": mu}

    def draw_noise(self, pipe: Any, params: GenerationParams, state: Any) -> torch.Tensor:
        """Drawn as the VAE's (1, 1, C, H/8, W/8), one draw per output, then packed: as
        ``QwenImagePipeline`` does."""
        from diffusers.utils.torch_utils import randn_tensor

        h, w = self._grid(pipe, params)
        channels = pipe.transformer.config.in_channels // 4
        shape = (1, 1, channels, h * 2, w * 2)
        dtype = module_dtype(pipe.transformer)
        noise = torch.cat([randn_tensor(shape, generator=g, device=self.device, dtype=dtype) for g in state.generators])
        return pipe._pack_latents(noise, params.num_images, channels, h * 2, w * 2)

    def in_latent_layout(self, pipe: Any, params: GenerationParams, x: torch.Tensor) -> torch.Tensor:
        """Packed as the latents are; a mask first given each latent channel, as
        QwenImageInpaintPipeline does."""
        channels = pipe.transformer.config.in_channels // 4
        if x.shape[1] == 1:
            x = x.repeat(1, channels, 1, 1)
        return pipe._pack_latents(x, x.shape[0], channels, x.shape[2], x.shape[3])

    def output_latents(self, pipe: Any, params: GenerationParams, latents: torch.Tensor) -> torch.Tensor:
        return pipe._unpack_latents(latents, params.height, params.width, pipe.vae_scale_factor)[:, :, 0]

    def combine_guidance(
        self, pipe: Any, uncond: torch.Tensor, cond: torch.Tensor, scale: float | torch.Tensor
    ) -> torch.Tensor:
        """Classifier-free guidance rescaled, token by token, to the norm of the
        prompt's prediction (``QwenImagePipeline``'s), so guidance steers and never
        inflates the velocity."""
        combined = uncond + scale * (cond - uncond)
        return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    def prepare_network(self, pipe: Any, spec: ModelSpec, options: speed.SpeedOptions) -> None:
        super().prepare_network(pipe, spec, options)
        if options.compile:
            self._compiled.add(self.network(pipe))

    def call_network(
        self, pipe: Any, x: torch.Tensor, t: torch.Tensor, c: Conditioning, runs: list[DiffusersRun]
    ) -> Any:
        rows = x.shape[0]
        network = pipe.transformer
        if network in self._compiled:
            c = c.text_padded(text_length(pipe.tokenizer, self.compiled_text_len))
        degree = sequence_degree(network)
        if degree > 1 and c.embeds is not None and c.embeds.shape[1] % degree:
            # A sequence split shares the text's tokens out too: padded (masked) to share evenly.
            length = -(-c.embeds.shape[1] // degree) * degree
            negative = c.negative_embeds.shape[1] if c.negative_embeds is not None else length
            c = c.text_padded(length, -(-negative // degree) * degree)
        return network(
            hidden_states=x,
            timestep=t.expand(rows).to(x.dtype) / 1000,
            encoder_hidden_states=c.embeds,
            encoder_hidden_states_mask=c.mask,
            img_shapes=[self._image_shapes(pipe, runs[0])] * rows,
            return_dict=False,
        )[0]

    def _image_shapes(self, pipe: Any, run: DiffusersRun) -> list[tuple[int, int, int]]:
        """The (frames, height, width) of each image the network's tokens hold: its latents'."""
        return [(1, *self._grid(pipe, run.member.params))]

    def _grid(self, pipe: Any, params: GenerationParams) -> tuple[int, int]:
        """The packed latents' height and width: a 2x2 patch of the VAE's latents each."""
        scale = pipe.vae_scale_factor * 2
        return params.height // scale, params.width // scale


class QwenImageEditDenoiser(QwenImageDenoiser):
    """Qwen-Image-Edit (``QwenImageEditPipeline``): instruction edits. Every job edits
    an input image (the gateway refuses one without) from noise: no strength, no mask.
    The image is resized to ``EDIT_CONDITION_AREA`` at its own aspect ratio, within
    4:1 (``gpu_worker.jobs.edit_inputs``): its pixels go to the text encoder beside the
    prompt, so the conditioning is cached under the image's digest too; its latents
    (the decoder's VAE's) are the member's extras, so its checkpoints carry them, and
    go into each call as tokens after the denoised ones, whose output is dropped.
    Members share a call only where their images' token grids agree. Every text is at
    most EDIT_TEXT_LEN tokens (cut there as it is encoded), the length a compiled
    network pads them to: no prompt's length fails a call its batch shares."""

    compiled_text_len = EDIT_TEXT_LEN

    def pipeline_parts(self, spec: ModelSpec) -> dict[str, Any]:
        """The processor too, for images alone (``services.models.qwen_processor``)."""
        from services.models.qwen_processor import load_processor

        source, _ = resolve_source(spec, self.models_dir)
        return {**super().pipeline_parts(spec), "processor": load_processor(Path(source) / "processor")}

    def encode_cached(
        self, pipe: Any, spec: ModelSpec, params: GenerationParams, inputs: MemberInputs | None = None
    ) -> Conditioning:
        """The prompt's and the input image's conditioning, cached under both."""
        if inputs is None or (inputs.prompt_image is None and inputs.conditioning is None):
            raise no_input_image(params.model)
        return super().encode_cached(pipe, spec, params, inputs)

    def conditioning_key(self, params: GenerationParams, cfg: bool) -> tuple[Any, ...]:
        return (*prompt_key(params, cfg), params.image_digest)

    def conditioning(
        self, pipe: Any, spec: ModelSpec, params: GenerationParams, cfg: bool, inputs: MemberInputs | None
    ) -> Conditioning:
        """Each text alone with the image, as the pipeline encodes them (the shared
        encoding's): its processor takes the image's pixels as a picture."""
        if self.text_elsewhere(spec) or inputs is None or inputs.prompt_image is None:
            return super().conditioning(pipe, spec, params, cfg, inputs)
        device = self.text_device(pipe)
        return Conditioning.encode(pipe, spec.family, params, device, cfg, image=inputs.prompt_image)

    def call_key(self, pipe: Any, run: DiffusersRun) -> Any:
        return self._condition_grid(run)

    def start(self, pipe: Any, run: DiffusersRun, member: BatchMember) -> None:
        state = run.state
        assert state is not None
        params = member.params
        state.latents = self.draw_noise(pipe, params, state)
        image = _image_latents(member).to(self.device, state.latents.dtype).repeat(params.num_images, 1, 1, 1)
        packed = pipe._pack_latents(image, params.num_images, image.shape[1], image.shape[2], image.shape[3])
        state.extras = {IMAGE_LATENTS: packed}

    def model_input(self, run: DiffusersRun, latents: torch.Tensor) -> torch.Tensor:
        assert run.state is not None
        return torch.cat([latents, run.state.extras[IMAGE_LATENTS]], dim=1)

    def call_network(
        self, pipe: Any, x: torch.Tensor, t: torch.Tensor, c: Conditioning, runs: list[DiffusersRun]
    ) -> Any:
        h, w = self._grid(pipe, runs[0].member.params)
        return super().call_network(pipe, x, t, c, runs)[:, : h * w]

    def _image_shapes(self, pipe: Any, run: DiffusersRun) -> list[tuple[int, int, int]]:
        """The denoised latents' grid, then the input image's."""
        return [*super()._image_shapes(pipe, run), (1, *self._condition_grid(run))]

    def _condition_grid(self, run: DiffusersRun) -> tuple[int, int]:
        """The input image's packed grid: a 2x2 patch of its latents each."""
        latents = _image_latents(run.member)
        return latents.shape[2] // 2, latents.shape[3] // 2

    def warm_up_inputs(self, spec: ModelSpec, params: GenerationParams) -> MemberInputs | None:
        """A blank input image of the output's aspect ratio, and its latents: 16 channels at an eighth of its size."""
        width, height = edit_condition_size(params.width, params.height)
        return MemberInputs(
            image_latents=torch.zeros(1, 16, height // 8, width // 8),
            prompt_image=torch.zeros(1, 3, height, width, dtype=torch.uint8),
        )


def _image_latents(member: BatchMember) -> torch.Tensor:
    """An edit's input latents: a job without is refused by the gateway and fails alone here."""
    if member.inputs is None or member.inputs.image_latents is None:
        raise no_input_image(member.params.model)
    return member.inputs.image_latents
