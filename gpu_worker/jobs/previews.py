"""Rough previews of images while they denoise: a model's latents seen
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

# (latent channel) x (R, G, B), for latents as the network denoises them, and a bias
# per colour: SD 1.5's and SDXL's four channels, SD 3's, Flux's and Wan 2.1's sixteen
# (ComfyUI's latent formats; Qwen-Image's VAE is Wan 2.1's).
_SD15 = [[0.298, 0.207, 0.208], [0.187, 0.286, 0.173], [-0.158, 0.189, 0.264], [-0.184, -0.271, -0.473]]
_SDXL = [[0.3651, 0.4232, 0.4341], [-0.2533, -0.0042, 0.1068], [0.1076, 0.1111, -0.0362], [-0.3165, -0.2492, -0.2188]]
_SD3 = [
    [-0.0922, -0.0175, 0.0749], [0.0311, 0.0633, 0.0954], [0.1994, 0.0927, 0.0458], [0.0856, 0.0339, 0.0902],
    [0.0587, 0.0272, -0.0496], [-0.0006, 0.1104, 0.0309], [0.0978, 0.0306, 0.0427], [-0.0042, 0.1038, 0.1358],
    [-0.0194, 0.0020, 0.0669], [-0.0488, 0.0130, -0.0268], [0.0922, 0.0988, 0.0951], [-0.0278, 0.0524, -0.0542],
    [0.0332, 0.0456, 0.0895], [-0.0069, -0.0030, -0.0810], [-0.0596, -0.0465, -0.0293], [-0.1448, -0.1463, -0.1189],
]  # fmt: skip
_FLUX = [
    [-0.0346, 0.0244, 0.0681], [0.0034, 0.0210, 0.0687], [0.0275, -0.0668, -0.0433], [-0.0174, 0.0160, 0.0617],
    [0.0859, 0.0721, 0.0329], [0.0004, 0.0383, 0.0115], [0.0405, 0.0861, 0.0915], [-0.0236, -0.0185, -0.0259],
    [-0.0245, 0.0250, 0.1180], [0.1008, 0.0755, -0.0421], [-0.0515, 0.0201, 0.0011], [0.0428, -0.0012, -0.0036],
    [0.0817, 0.0765, 0.0749], [-0.1264, -0.0522, -0.1103], [-0.0280, -0.0881, -0.0499], [-0.1262, -0.0982, -0.0778],
]  # fmt: skip
_WAN21 = [
    [-0.1299, -0.1692, 0.2932], [0.0671, 0.0406, 0.0442], [0.3568, 0.2548, 0.1747], [0.0372, 0.2344, 0.1420],
    [0.0313, 0.0189, -0.0328], [0.0296, -0.0956, -0.0665], [-0.3477, -0.4059, -0.2925], [0.0166, 0.1902, 0.1975],
    [-0.0412, 0.0267, -0.1364], [-0.1293, 0.0740, 0.1636], [0.0680, 0.3019, 0.1128], [0.0032, 0.0581, 0.0639],
    [-0.1251, 0.0927, 0.1699], [0.0060, -0.0633, 0.0005], [0.3477, 0.2275, 0.2950], [0.1984, 0.0913, 0.1861],
]  # fmt: skip
_NO_BIAS = [0.0, 0.0, 0.0]
_FACTORS = {
    ModelFamily.SDXL: (_SDXL, _NO_BIAS),
    ModelFamily.SD3: (_SD3, [0.2394, 0.2135, 0.1925]),
    ModelFamily.FLUX: (_FLUX, [-0.0329, -0.0718, -0.0851]),
    ModelFamily.QWEN_IMAGE: (_WAN21, [-0.1835, -0.0868, -0.3360]),
    ModelFamily.Z_IMAGE: (_FLUX, [-0.0329, -0.0718, -0.0851]),  # Flux.1's VAE, so its latent space
    ModelFamily.QWEN_IMAGE_EDIT: (_WAN21, [-0.1835, -0.0868, -0.3360]),
}
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
    """Each image's preview, a JPEG of ``width`` x ``height``, from its latents (n, C, h, w)."""
    table, bias = _FACTORS.get(family, (_SD15, _NO_BIAS))
    factors = torch.tensor(table, dtype=torch.float32)
    rgb = torch.einsum("nchw,cr->nhwr", latents.float().cpu(), factors) + torch.tensor(bias)
    pixels = ((rgb + 1) * 127.5).clamp(0, 255).round().to(torch.uint8).numpy()
    out = []
    for image in pixels:
        buf = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(image)).resize((width, height), Image.Resampling.BILINEAR).save(
            buf, format="JPEG", quality=JPEG_QUALITY
        )
        out.append(buf.getvalue())
    return out
