"""An uploaded adapter's file: received from the upload's stream, exactly the bytes
its header declared, and checked (``services.models.adapters.checking``) in a
process of its own, given none of the gateway's settings, within a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.errors import FieldViolation, InvalidArgument
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

# What an upload's file is called in the directory it is checked and pushed from.
FILE = "adapter.safetensors"


@dataclass(frozen=True)
class Checked:
    """What the check of an uploaded file found."""

    rank: int
    layers: int
    skipped: tuple[str, ...]


async def header_of(messages: AsyncIterator[pb.UploadAdapterRequest]) -> pb.AdapterUpload:
    first = await anext(aiter(messages), None)
    if first is None or first.WhichOneof("part") != "header":
        raise InvalidArgument([FieldViolation("header", "an upload's first message is its header")])
    return first.header


async def receive(messages: AsyncIterator[pb.UploadAdapterRequest], path: Path, size: int) -> None:
    """The chunks written to ``path`` (each in a thread): exactly ``size`` bytes, or InvalidArgument."""
    received = 0
    out = await asyncio.to_thread(open, path, "wb")
    try:
        async for message in messages:
            if message.WhichOneof("part") != "chunk":
                raise InvalidArgument([FieldViolation("header", "an upload has one header, first")])
            received += len(message.chunk)
            if received > size:
                raise InvalidArgument([FieldViolation("size_bytes", f"the file is longer than its {size} bytes")])
            await asyncio.to_thread(out.write, message.chunk)
    finally:
        await asyncio.to_thread(out.close)
    if received != size:
        raise InvalidArgument([FieldViolation("size_bytes", f"{received} bytes came of its {size}")])


async def run_check(request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """``services.models.adapters.checking`` on ``request``, in a process of its own,
    given none of this process's settings (it reads none)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DARKROOM_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.models.adapters.checking",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(json.dumps(request).encode()), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return {"error": f"its check took longer than {timeout_s:.0f}s"}
    try:
        answer = json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"it could not be read as a LoRA adapter (its reader exited with {proc.returncode})"}
    return answer if isinstance(answer, dict) else {"error": "its check answered nothing"}
