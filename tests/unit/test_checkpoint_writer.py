"""Periodic checkpoints are stored latest first: while one write is under way, a
newer checkpoint replaces any that waits, so a slow database skips checkpoints
instead of queueing them; a failed write does not stop the next."""

from __future__ import annotations

import asyncio

from gpu_worker.checkpoints.format import Checkpoint
from gpu_worker.checkpoints.writer import PeriodicCheckpointWriter
from services.errors import StoreUnavailable


async def test_a_slow_write_skips_to_the_latest_checkpoint() -> None:
    release = asyncio.Event()
    written: list[int] = []

    async def save(checkpoint: Checkpoint) -> bool:
        if checkpoint.step == 1:
            await release.wait()
        if checkpoint.step == 2:
            raise StoreUnavailable("database away")
        written.append(checkpoint.step)
        return True

    loop = asyncio.get_running_loop()
    saver = PeriodicCheckpointWriter("job", 1, save, loop)
    saver.offer(Checkpoint(1, 10, b"1"))
    await asyncio.sleep(0)  # the first write begins and waits
    for step in (2, 3, 4):
        saver.offer(Checkpoint(step, 10, str(step).encode()))
    await asyncio.sleep(0)
    release.set()
    await asyncio.sleep(0)
    await saver.settled()
    assert written == [1, 4] and saver.saved_step == 4

    saver.offer(Checkpoint(2, 10, b"2"))  # fails: logged, and the saver goes on
    await asyncio.sleep(0)
    await saver.settled()
    saver.offer(Checkpoint(6, 10, b"6"))
    await asyncio.sleep(0)
    await saver.settled()
    assert written == [1, 4, 6] and saver.saved_step == 6
