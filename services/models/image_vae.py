"""Qwen-Image's VAE (``AutoencoderKLQwenImage``: Wan 2.1's, a causal 3D VAE) for
still images: its latents normalised per channel by the config's ``latents_mean``
and ``latents_std`` and given a frame axis of one, exactly as ``QwenImagePipeline``
(decoding) and its image-to-image pipeline (encoding) do."""

from __future__ import annotations

from typing import Any

import torch


def vae_input(vae: Any, latents: torch.Tensor) -> torch.Tensor:
    """Denoised latents (N, C, h, w) as the VAE decodes them: (N, C, 1, h, w), un-normalised."""
    mean, inverse_std = _statistics(vae, latents)
    return latents.unsqueeze(2) / inverse_std + mean


def denoised_latents(vae: Any, encoded: torch.Tensor) -> torch.Tensor:
    """The VAE's encoding of an image (N, C, 1, h, w) as the network denoises it: (N, C, h, w), normalised."""
    mean, inverse_std = _statistics(vae, encoded)
    return ((encoded - mean) * inverse_std)[:, :, 0]


def _statistics(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel mean and 1/std, shaped (1, C, 1, 1, 1), on ``like``'s device and dtype."""
    config = vae.config
    mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(like.device, like.dtype)
    inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(like.device, like.dtype)
    return mean, inverse_std
