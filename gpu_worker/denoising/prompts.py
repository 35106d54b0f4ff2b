"""Prompt conditioning (text embeddings, and SDXL's pooled embeddings and size ids),
and a cache of it bounded by bytes: a prompt sent again, or a batch-mate with the
same prompt, skips the text encoders. Text embeddings of a length that varies with
the prompt (Qwen-Image's) stack padded to the longest, with a mask of their tokens."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from services.models import prompt_encoding
from services.models.prompt_encoding import text_length
from services.models.spec import ModelFamily

__all__ = ["HOST_FIELDS", "Conditioning", "PromptCache", "prompt_key", "text_length"]

# What stays on the host wherever the rest goes: what the network's call reads as
# numbers (a device tensor would be read back).
HOST_FIELDS = frozenset({"text_lengths", "negative_text_lengths"})


@dataclass(frozen=True)
class Conditioning:
    """One prompt's conditioning, one row per tensor (or ``rows(n)`` of them)."""

    embeds: torch.Tensor | None = None
    negative_embeds: torch.Tensor | None = None
    pooled: torch.Tensor | None = None  # SDXL
    negative_pooled: torch.Tensor | None = None
    time_ids: torch.Tensor | None = None  # SDXL: original size, crop, target size
    # Text of a length that varies with the prompt, padded: True at a token, False at
    # padding. None: every position a token (a prompt alone is never padded).
    mask: torch.Tensor | None = None
    negative_mask: torch.Tensor | None = None
    # Z-Image: each row's prompt tokens, kept on the host (``HOST_FIELDS``): its
    # network takes each row's text cut to its own length.
    text_lengths: torch.Tensor | None = None
    negative_text_lengths: torch.Tensor | None = None

    @classmethod
    def empty(cls) -> Conditioning:
        return cls()

    @classmethod
    def encode(
        cls, pipe: Any, family: ModelFamily, req: Any, device: torch.device, cfg: bool, **extras: Any
    ) -> Conditioning:
        """``req``'s conditioning by ``pipe``'s text encoders on ``device``: the shared
        encoding (``services.models.prompt_encoding``) the decoder service runs too."""
        return cls.of(prompt_encoding.encode(pipe, family, req, device, cfg, **extras))

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> Conditioning:
        """From named tensors (``prompt_encoding``'s); a name it has no field for is an error."""
        unknown = set(tensors) - _FIELDS
        if unknown:
            raise ValueError(f"a conditioning has no {sorted(unknown)}")
        return cls(**tensors)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Its tensors by name, those it has: what ``of`` takes back."""
        return self._tensors()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors().values())

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def to(self, device: torch.device) -> Conditioning:
        """On ``device`` (itself where it is there already), but for ``HOST_FIELDS``."""
        tensors = {k: t for k, t in self._tensors().items() if k not in HOST_FIELDS}
        if all(t.device == device for t in tensors.values()):
            return self
        return replace(self, **{k: t.to(device) for k, t in tensors.items()})

    def rows(self, n: int) -> Conditioning:
        """The conditioning of ``n`` images of the same prompt."""
        return Conditioning(**{k: t.repeat_interleave(n, dim=0) for k, t in self._tensors().items()})

    def padded(self, n: int) -> Conditioning:
        """With ``n`` more rows, copies of the last: a batch padded to a bucket."""
        return Conditioning(**{k: torch.cat([t, t[-1:].expand(n, *t.shape[1:])]) for k, t in self._tensors().items()})

    def negative(self) -> Conditioning:
        """The unconditional half of classifier-free guidance, as a positive conditioning."""
        return Conditioning(
            embeds=self.negative_embeds,
            pooled=self.negative_pooled,
            time_ids=self.time_ids,
            mask=self.negative_mask,
            text_lengths=self.negative_text_lengths,
        )

    def text_padded(self, length: int, negative_length: int | None = None) -> Conditioning:
        """With its text (and its negative text) padded to ``length`` (``negative_length``,
        by default ``length``) tokens, masked: the padding is zeros no token attends to."""
        assert self.embeds is not None
        embeds, mask = _padded_text(self.embeds, self.mask, length)
        if self.negative_embeds is None:
            return replace(self, embeds=embeds, mask=mask)
        negative_length = length if negative_length is None else negative_length
        negative, negative_mask = _padded_text(self.negative_embeds, self.negative_mask, negative_length)
        return replace(self, embeds=embeds, mask=mask, negative_embeds=negative, negative_mask=negative_mask)

    @staticmethod
    def stack(parts: Sequence[Conditioning]) -> Conditioning:
        """The parts' rows in one conditioning; texts of other lengths padded to the longest."""
        lengths = {p.embeds.shape[1] for p in parts if p.embeds is not None}
        negative_lengths = {p.negative_embeds.shape[1] for p in parts if p.negative_embeds is not None}
        masked = any(p.mask is not None or p.negative_mask is not None for p in parts)
        if len(lengths) > 1 or len(negative_lengths) > 1 or masked:
            parts = [p.text_padded(max(lengths), max(negative_lengths, default=None)) for p in parts]
        names = parts[0]._tensors().keys()
        return Conditioning(**{k: torch.cat([p._tensors()[k] for p in parts]) for k in names})

    def added_cond_kwargs(self) -> dict[str, torch.Tensor] | None:
        if self.pooled is None or self.time_ids is None:
            return None
        return {"text_embeds": self.pooled, "time_ids": self.time_ids}


_FIELDS = frozenset(f.name for f in fields(Conditioning))


def _padded_text(embeds: torch.Tensor, mask: torch.Tensor | None, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``embeds`` (rows, tokens, width) padded with zeros to ``length`` tokens, and its mask."""
    rows, tokens, width = embeds.shape
    if mask is None:
        mask = torch.ones(rows, tokens, dtype=torch.bool, device=embeds.device)
    if tokens == length:
        return embeds, mask
    embeds = torch.cat([embeds, embeds.new_zeros(rows, length - tokens, width)], dim=1)
    return embeds, torch.cat([mask, mask.new_zeros(rows, length - tokens)], dim=1)


def prompt_key(params: Any, cfg: bool) -> tuple[Any, ...]:
    """What a job's conditioning depends on (its model first: ``PromptCache.forget``),
    ``cfg`` whether it has a negative half."""
    return (params.model, params.prompt, params.negative_prompt, cfg, params.width, params.height)


class PromptCache:
    """Least recently used conditionings, up to ``max_bytes`` in all."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[Hashable, Conditioning] = OrderedDict()
        self._lock = threading.Lock()
        # One encoding at a time, whichever thread asks (the sampling thread, a batch
        # prepared ahead, prompts encoded while a start is written): text encoders'
        # tokenizers are not safe to share between threads, and a thread that wants
        # a prompt being encoded waits for it instead of encoding it again.
        self._encoding = threading.Lock()

    def _cached(self, key: tuple[Any, ...]) -> Conditioning | None:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            return found

    def get(self, key: tuple[Any, ...], compute: Callable[[], Conditioning]) -> Conditioning:
        found = self._cached(key)
        if found is not None:
            return found
        with self._encoding:
            found = self._cached(key)
            if found is not None:
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
