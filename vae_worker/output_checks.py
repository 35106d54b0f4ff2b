"""The image filter on the decoder's event loop. Every output of a job with an
output policy is scored before anything of it is sent; the outputs of requests
that finish together (a batch's, resolved at once) are scored in one classifier
call, on a thread of its own: the next batch's VAE call runs meanwhile, and the
outputs' encoding too, so the filter adds the difference between its time and the
encoding's to a request, and nothing to the decoder's throughput while its CPU
has room. onnxruntime on the CPU: it costs the GPU nothing."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from services.coalesce import Coalescer
from services.safety.image_filter import ImageFilter


class OutputChecks:
    def __init__(self, image_filter: ImageFilter) -> None:
        self.filter = image_filter
        # One thread: calls run one at a time, each on a batch (onnxruntime's own
        # threads work within a call).
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="image-filter")
        self._scores = Coalescer(self._score_many)

    async def scores(self, outputs: list[np.ndarray]) -> list[float]:
        """One score per output (``ImageFilter.scores``), in a classifier call
        shared with the other requests' outputs that wait meanwhile."""
        return await self._scores(outputs)

    async def _score_many(self, requests: list[list[np.ndarray]]) -> list[list[float]]:
        together = [output for outputs in requests for output in outputs]
        scores = await asyncio.get_running_loop().run_in_executor(self._pool, self.filter.scores, together)
        out, start = [], 0
        for outputs in requests:
            out.append(scores[start : start + len(outputs)])
            start += len(outputs)
        return out
