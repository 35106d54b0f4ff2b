"""Gathers concurrent decode requests into batches, and keeps the decoder's load.

Requests for the same model and latent shape (channels, [frames,] height, width) that arrive
within ``wait_s`` of a batch's first run as one VAE call of at most ``max_images``
images (a larger request runs alone). One batch runs at a time; a batch whose wait
is over keeps taking requests until its turn comes, so batches grow with load."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from services.models.vae import DecodedImage, VaeDecoderEngine
from vae_worker.metrics import DECODE_BATCH_IMAGES, DECODE_SECONDS, DECODER_QUEUED_IMAGES, DECODER_QUEUED_MEGAPIXELS

# Pixels per latent along each side, for the work a waiting request holds (SD's VAEs).
LATENT_SCALE = 8
VIDEO_FRAMES_PER_LATENT = 4
# Weight of the newest batch in the measured speed.
SPEED_SMOOTHING = 0.3


@dataclass(frozen=True)
class BatchKey:
    model: str
    latent_shape: tuple[int, ...]  # (channels, height, width), a video's (channels, frames, height, width)


@dataclass
class _Request:
    latents: torch.Tensor
    done: asyncio.Future[list[DecodedImage]]

    @property
    def images(self) -> int:
        return int(self.latents.shape[0])


@dataclass
class _Batch:
    key: BatchKey
    requests: list[_Request] = field(default_factory=list)
    ready: bool = False  # full, or its wait is over
    timer: asyncio.TimerHandle | None = None

    @property
    def images(self) -> int:
        return sum(r.images for r in self.requests)


def _smoothed(old: float | None, new: float) -> float:
    return new if old is None else (1 - SPEED_SMOOTHING) * old + SPEED_SMOOTHING * new


class DecodeBatcher:
    def __init__(self, engine: VaeDecoderEngine, *, wait_s: float, max_images: int) -> None:
        self.engine = engine
        self.wait_s = wait_s
        self.max_images = max_images
        self._open: dict[BatchKey, _Batch] = {}  # taking requests
        self._waiting: list[_Batch] = []  # not yet run, oldest first
        self._running: list[_Request] = []
        self._runner: asyncio.Task[None] | None = None
        self.batches = 0
        self.images = 0
        self.tiled_images = 0
        self.largest_batch = 0
        self.seconds_per_megapixel: float | None = None
        self.seconds_per_image: float | None = None

    async def decode(self, model: str, latents: torch.Tensor) -> list[DecodedImage]:
        """``latents`` (batch, channels, height, width) decoded, one image each, in
        whichever batch they join."""
        self.engine.check_model(model)  # an unknown model fails alone, not the batch it would join
        key = BatchKey(model, tuple(int(d) for d in latents.shape[1:]))
        request = _Request(latents, asyncio.get_running_loop().create_future())
        # Decoded, failed or given up by its caller: the load falls either way.
        request.done.add_done_callback(lambda _: self._show_load())
        batch = self._open.get(key)
        if batch is not None and batch.images + request.images > self.max_images:
            self._close(batch)
            batch = None
        if batch is None:
            batch = self._open[key] = _Batch(key)
            self._waiting.append(batch)
            batch.timer = asyncio.get_running_loop().call_later(self.wait_s, self._wait_over, batch)
        batch.requests.append(request)
        self._show_load()
        if batch.images >= self.max_images:
            self._close(batch)
        return await request.done

    def _held(self) -> list[_Request]:
        """The work it holds: waiting (and still wanted) and decoding (wanted or not,
        the VAE call goes on)."""
        return [r for b in self._waiting for r in b.requests if not r.done.done()] + self._running

    def _show_load(self) -> None:
        held = self._held()
        DECODER_QUEUED_IMAGES.set(sum(r.images for r in held))
        DECODER_QUEUED_MEGAPIXELS.set(sum(_megapixels(r.latents) for r in held))

    def telemetry(self) -> dict[str, Any]:
        """The decoder's load, for its heartbeat: the work it holds (waiting and
        decoding) and how fast it goes, and what it has done."""
        held = self._held()
        return {
            "queued_images": sum(r.images for r in held),
            "queued_megapixels": round(sum(_megapixels(r.latents) for r in held), 6),
            "seconds_per_megapixel": self.seconds_per_megapixel,
            "seconds_per_image": self.seconds_per_image,
            "decoded_batches": self.batches,
            "decoded_images": self.images,
            "tiled_images": self.tiled_images,
            "largest_batch": self.largest_batch,
        }

    def _close(self, batch: _Batch) -> None:
        """The batch takes no more requests and runs at its turn."""
        if self._open.get(batch.key) is batch:
            del self._open[batch.key]
        self._wait_over(batch)

    def _wait_over(self, batch: _Batch) -> None:
        batch.ready = True
        if self._runner is None:
            self._runner = asyncio.create_task(self._run_ready())

    async def _run_ready(self) -> None:
        try:
            while (batch := self._take_ready()) is not None:
                await self._run(batch)
        finally:
            # Reached with no await since the last check: a batch ready from now
            # on starts a new runner.
            self._runner = None

    def _take_ready(self) -> _Batch | None:
        for batch in self._waiting:
            if batch.ready:
                self._waiting.remove(batch)
                if self._open.get(batch.key) is batch:
                    del self._open[batch.key]
                if batch.timer is not None:
                    batch.timer.cancel()
                return batch
        return None

    async def _run(self, batch: _Batch) -> None:
        requests = [r for r in batch.requests if not r.done.done()]  # not given up by its caller
        if not requests:
            return
        latents = torch.cat([r.latents for r in requests])
        self._running = requests
        try:
            images, seconds = await asyncio.to_thread(self._decode, batch.key.model, latents)
        except Exception as exc:
            for r in requests:
                if not r.done.done():
                    r.done.set_exception(exc)
            return
        finally:
            self._running = []
            self._show_load()
        self._count(batch.key.model, images, seconds)
        start = 0
        for r in requests:
            if not r.done.done():
                r.done.set_result(images[start : start + r.images])
            start += r.images

    def _decode(self, model: str, latents: torch.Tensor) -> tuple[list[DecodedImage], float]:
        self.engine.load(model)  # a first load is no measure of decoding speed
        started = time.perf_counter()
        images = self.engine.decode_images(model, latents)
        return images, time.perf_counter() - started

    def _count(self, model: str, images: list[DecodedImage], seconds: float) -> None:
        DECODE_BATCH_IMAGES.labels(model=model).observe(len(images))
        DECODE_SECONDS.labels(model=model).observe(seconds)
        self.batches += 1
        self.images += len(images)
        self.tiled_images += sum(1 for i in images if i.tiled)
        self.largest_batch = max(self.largest_batch, len(images))
        megapixels = sum(i.pixels[..., 0].size for i in images) / 1e6  # a video's frames' too
        self.seconds_per_megapixel = _smoothed(self.seconds_per_megapixel, seconds / megapixels)
        self.seconds_per_image = _smoothed(self.seconds_per_image, seconds / len(images))


def _megapixels(latents: torch.Tensor) -> float:
    n, h, w = latents.shape[0], latents.shape[-2], latents.shape[-1]
    # A video's latent frame is four frames (its first, one): Wan's VAE.
    frames = (int(latents.shape[2]) - 1) * VIDEO_FRAMES_PER_LATENT + 1 if latents.dim() == 5 else 1
    return int(n) * frames * int(h) * int(w) * LATENT_SCALE**2 / 1e6
