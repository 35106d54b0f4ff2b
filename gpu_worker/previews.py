"""Rough previews of images while they denoise: an SD-family model's latents seen
as colours through a fixed linear map (the factors community ``latent2rgb``
previews use; SDXL's latent space has its own), resized to the image's size and
encoded as a small JPEG. No VAE: a preview costs a matrix product, not a decode.
None is taken of a job whose output policy withholds or blurs flagged outputs: a
preview is never scored. Pure."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from services.db.records import JobRecord
from services.models.spec import ModelFamily
from services.safety.verdicts import previews_allowed

# (latent channel) x (R, G, B), for latents as the UNet denoises them.
_SD15 = [[0.298, 0.207, 0.208], [0.187, 0.286, 0.173], [-0.158, 0.189, 0.264], [-0.184, -0.271, -0.473]]
_SDXL = [[0.3651, 0.4232, 0.4341], [-0.2533, -0.0042, 0.1068], [0.1076, 0.1111, -0.0362], [-0.3165, -0.2492, -0.2188]]
JPEG_QUALITY = 70


def preview_steps(total: int, count: int) -> frozenset[int]:
    """The steps after which ``count`` previews are taken: evenly spaced, never the last."""
    return frozenset(round(total * k / (count + 1)) for k in range(1, count + 1)) - {0, total}


def job_preview_steps(job: JobRecord) -> frozenset[int]:
    """The steps after which ``job``'s previews are taken: none where its stored
    output policy does not allow them, whatever its count says (a job stored by a
    gateway that did not drop them: before the policy held, or during an upgrade)."""
    if not previews_allowed(job.output_policy):
        return frozenset()
    return preview_steps(job.params.steps, job.previews)


def previews(latents: torch.Tensor, family: ModelFamily, width: int, height: int) -> list[bytes]:
    """Each image's preview, a JPEG of ``width`` x ``height``, from its latents (n, 4, h, w)."""
    factors = torch.tensor(_SDXL if family == ModelFamily.SDXL else _SD15, dtype=torch.float32)
    rgb = torch.einsum("nchw,cr->nhwr", latents.float().cpu(), factors)
    pixels = ((rgb + 1) * 127.5).clamp(0, 255).round().to(torch.uint8).numpy()
    out = []
    for image in pixels:
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(image)).resize((width, height), Image.Resampling.BILINEAR).save(
            buf, format="JPEG", quality=JPEG_QUALITY
        )
        out.append(buf.getvalue())
    return out
