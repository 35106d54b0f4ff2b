"""An uploaded adapter's file: received from the upload's stream, exactly the bytes
its header declared, and checked (``services.models.adapters.checking``) in a
process of its own, given none of the gateway's settings, within a deadline. The
request goes to the check as a file, not down a pipe: a check that ends before it
reads is then told apart from one that refuses the file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.errors import FieldViolation, InvalidArgument, ResourceExhausted
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb

log = logging.getLogger(__name__)

CHECKER = "services.models.adapters.checking"
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


# A safetensors header larger than this is no adapter's (its tensors' names and shapes).
_LARGEST_HEADER = 16 * 2**20


def check_framing(path: Path) -> None:
    """InvalidArgument naming ``file`` unless ``path`` is framed as a safetensors file
    (an 8-byte length, a JSON header of that length, each tensor's bytes within the
    file): read at once, here, so that what is not one costs no check's process."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 2 <= length <= min(size - 8, _LARGEST_HEADER):
            raise InvalidArgument([FieldViolation("file", "not a safetensors file: no header of its length")])
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise InvalidArgument([FieldViolation("file", "not a safetensors file: its header is no JSON object")])
    data = size - 8 - length
    for name, tensor in header.items():
        if name == "__metadata__":
            continue
        offsets = tensor.get("data_offsets") if isinstance(tensor, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise InvalidArgument([FieldViolation("file", f"not a safetensors file: tensor {name[:80]!r}")])
        if not 0 <= offsets[0] <= offsets[1] <= data:
            raise InvalidArgument([FieldViolation("file", f"tensor {name[:80]!r} lies past the file's end")])


# A reader killed by one of these crashed on the file it read: the file's fault. One
# killed otherwise (SIGKILL: the kernel short of memory, an operator) or that ended
# without an answer could not check it here now: nobody's, retried.
_CRASHED_ON_INPUT = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGFPE, signal.SIGILL})


async def check(request: dict[str, Any], scratch: Path, timeout_s: float, *, module: str = CHECKER) -> Checked:
    """``services.models.adapters.checking`` on ``request`` (written into
    ``scratch``), in a process of its own, given none of this process's settings
    (it reads none): what it found, or InvalidArgument naming ``file`` where the
    file is refused or crashed its reader (twice: a crash once is looked at again,
    as a reader may crash for reasons of its own), or ResourceExhausted (retry)
    where the check could not run to its end."""
    asked = scratch / "check.json"
    await asyncio.to_thread(asked.write_text, json.dumps(request))
    for attempt in (1, 2):
        code, out, err = await _run(module, asked, timeout_s)
        answer = _answer(out)
        if answer is not None:
            break
        crashed = code < 0 and -code in _CRASHED_ON_INPUT
        if crashed and attempt == 2:
            why = f"it could not be read as a LoRA adapter: its reader crashed ({signal.Signals(-code).name})"
            raise InvalidArgument([FieldViolation("file", why)])
        log.warning("an adapter's check ended with %s and no answer: %s", code, err.decode(errors="replace")[-2000:])
        if not crashed:
            raise ResourceExhausted(f"the gateway could not check the adapter now (its check ended with {code})", 5.0)
    assert answer is not None
    if "error" in answer:
        raise InvalidArgument([FieldViolation("file", str(answer["error"]))])
    return Checked(int(answer["rank"]), int(answer["layers"]), tuple(answer["skipped"]))


async def _run(module: str, asked: Path, timeout_s: float) -> tuple[int, bytes, bytes]:
    """The check run once: its exit code (a signal's, negative), stdout and stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DARKROOM_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        str(asked),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**env, "OMP_NUM_THREADS": "1"},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise InvalidArgument([FieldViolation("file", f"its check took longer than {timeout_s:.0f}s")]) from None
    return proc.returncode or 0, out, err


def _answer(out: bytes) -> dict[str, Any] | None:
    try:
        answer = json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    return answer if isinstance(answer, dict) else None
