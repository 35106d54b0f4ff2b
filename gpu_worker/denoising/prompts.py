"""Prompt conditioning (text embeddings, and SDXL's pooled embeddings and size ids),
and a cache of it bounded by bytes: a prompt sent again, or a batch-mate with the
same prompt, skips the text encoders."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from services.models.spec import ModelFamily


@dataclass(frozen=True)
class Conditioning:
    """One prompt's conditioning, one row per tensor (or ``rows(n)`` of them)."""

    embeds: torch.Tensor | None = None
    negative_embeds: torch.Tensor | None = None
    pooled: torch.Tensor | None = None  # SDXL
    negative_pooled: torch.Tensor | None = None
    time_ids: torch.Tensor | None = None  # SDXL: original size, crop, target size

    @classmethod
    def empty(cls) -> Conditioning:
        return cls()

    @classmethod
    def encode(cls, pipe: Any, family: ModelFamily, req: Any, device: torch.device, cfg: bool) -> Conditioning:
        negative = req.negative_prompt or None
        if family == ModelFamily.SDXL:
            embeds, neg, pooled, neg_pooled = pipe.encode_prompt(
                prompt=req.prompt,
                device=device,
                num_images_per_prompt=1,
                do_classifier_free_guidance=cfg,
                negative_prompt=negative,
            )
            projection = pipe.text_encoder_2.config.projection_dim if pipe.text_encoder_2 is not None else None
            size = (req.height, req.width)
            time_ids = pipe._get_add_time_ids(
                size, (0, 0), size, dtype=embeds.dtype, text_encoder_projection_dim=projection
            ).to(device)
            return cls(embeds, neg if cfg else None, pooled, neg_pooled if cfg else None, time_ids)
        embeds, neg = pipe.encode_prompt(req.prompt, device, 1, cfg, negative)
        return cls(embeds, neg if cfg else None)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors().values())

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def to(self, device: torch.device) -> Conditioning:
        """On ``device`` (itself where it is there already)."""
        tensors = self._tensors()
        if all(t.device == device for t in tensors.values()):
            return self
        return Conditioning(**{k: t.to(device) for k, t in tensors.items()})

    def rows(self, n: int) -> Conditioning:
        """The conditioning of ``n`` images of the same prompt."""
        return Conditioning(**{k: t.repeat_interleave(n, dim=0) for k, t in self._tensors().items()})

    def padded(self, n: int) -> Conditioning:
        """With ``n`` more rows, copies of the last: a batch padded to a bucket."""
        return Conditioning(**{k: torch.cat([t, t[-1:].expand(n, *t.shape[1:])]) for k, t in self._tensors().items()})

    def negative(self) -> Conditioning:
        """The unconditional half of classifier-free guidance, as a positive conditioning."""
        return Conditioning(embeds=self.negative_embeds, pooled=self.negative_pooled, time_ids=self.time_ids)

    @staticmethod
    def stack(parts: Sequence[Conditioning]) -> Conditioning:
        names = parts[0]._tensors().keys()
        return Conditioning(**{k: torch.cat([p._tensors()[k] for p in parts]) for k in names})

    def added_cond_kwargs(self) -> dict[str, torch.Tensor] | None:
        if self.pooled is None or self.time_ids is None:
            return None
        return {"text_embeds": self.pooled, "time_ids": self.time_ids}


def prompt_key(params: Any, cfg: bool) -> tuple[Any, ...]:
    """What a job's conditioning depends on (its model first: ``PromptCache.forget``),
    ``cfg`` whether it has a negative half."""
    return (params.model, params.prompt, params.negative_prompt, cfg, params.width, params.height)


def text_length(tokenizer: Any, longest: int) -> int:
    """The T5 prompt length: the pipeline's, unless the tokenizer's own is shorter (a miniature's)."""
    if tokenizer is None:
        return longest
    return min(longest, int(tokenizer.model_max_length))


class PromptCache:
    """Least recently used conditionings, up to ``max_bytes`` in all."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[Hashable, Conditioning] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[Any, ...], compute: Callable[[], Conditioning]) -> Conditioning:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return found
        value = compute()
        with self._lock:
            self.misses += 1
            if key not in self._entries and value.nbytes <= self.max_bytes:
                self._entries[key] = value
                self.bytes += value.nbytes
                while self.bytes > self.max_bytes:
                    _, dropped = self._entries.popitem(last=False)
                    self.bytes -= dropped.nbytes
        return value

    def forget(self, model: str) -> None:
        """Drops a model's entries (keys start with the model's name)."""
        with self._lock:
            for key in [k for k in self._entries if k[0] == model]:  # type: ignore[index]
                self.bytes -= self._entries.pop(key).nbytes

    def __len__(self) -> int:
        return len(self._entries)
