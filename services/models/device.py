"""Which device a service computes on, and in which dtype."""

from __future__ import annotations

import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def pick_device(requested: str) -> torch.device:
    """``requested`` as given ("cuda", "cuda:1", "cpu"), or the GPU if there is one."""
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
