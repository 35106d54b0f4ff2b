"""Which device a service computes on, and in which dtype."""

from __future__ import annotations

import weakref
from typing import Any

import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def pick_device(requested: str) -> torch.device:
    """``requested`` as given ("cuda", "cuda:1", "cpu"), or the GPU if there is one."""
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# Each module's dtype, as diffusers' ``ModelMixin.dtype`` reads it: by walking every
# submodule for a casting hook, 1.75 ms for Flux's transformer, and families read
# it at every step. A module is cast as it loads and as its speed options are
# applied (``forget_dtype``), never while it serves: it is read once.
_DTYPES: weakref.WeakKeyDictionary[Any, torch.dtype] = weakref.WeakKeyDictionary()


def module_dtype(module: Any) -> torch.dtype:
    """``module.dtype``, read once per module object."""
    dtype = _DTYPES.get(module)
    if dtype is None:
        dtype = _DTYPES[module] = module.dtype
    return dtype


def forget_dtype(module: Any) -> None:
    """The next ``module_dtype`` reads ``module``'s afresh: it is about to be cast."""
    _DTYPES.pop(module, None)
