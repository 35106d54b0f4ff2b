"""An adapter's upload (``POST /v1/adapters``): its multipart form read part by
part and sent on to the gateway's ``UploadAdapter`` in chunks of at most
``CHUNK_BYTES``, never held whole.

The gateway's first message holds the file's size. A file part that declares its
length (``Content-Length``, which RFC 7578 lets a receiver ignore: the gateway
counts the bytes against it) and comes after ``name`` is sent on as it arrives;
any other is first spooled to a temporary file, bounded by the limit, and sent
from there. A file over the limit is refused (413 naming ``file``) before a byte
of it is read where its length is declared, else as it arrives; so is a body past
its route's limit. The gateway's refusal of the first message (a bad name, a
base model it cannot take, the tenant's rate) is answered before a byte of the
file is sent, the rest of the body unread: the gateway accepts the first message
with the call's initial metadata."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Awaitable
from typing import IO, TypeVar

from aiohttp import BodyPartReader, MultipartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from http_api.errors import HttpError, bad_request, quoted, too_large
from services.rpc.gen.darkroom.v1 import image_generation_pb2 as pb
from services.rpc.gen.darkroom.v1 import image_generation_pb2_grpc

CHUNK_BYTES = 4 * 2**20  # UploadAdapterRequest's largest chunk
# A text field's value (a name, a model's name): many times the longest the gateway takes.
FIELD_BYTES = 1024
FIELDS = ("name", "base_model")
# The whole call: the file's transfer (from the client, where it is sent on as it
# arrives), then the gateway's check of it (DARKROOM_ADAPTER_CHECK_TIMEOUT_S).
UPLOAD_TIMEOUT_S = 900.0
# Uploads a process reads at once, each spooling at most the limit to disk; the
# others wait, their bodies unread.
UPLOADS_AT_ONCE = 4
T = TypeVar("T")


def file_too_large(limit: int) -> HttpError:
    return HttpError(
        413,
        f"file is over the largest adapter of {limit} bytes (DARKROOM_MAX_ADAPTER_MB)",
        kind="invalid_request_error",
        param="file",
    )


class AdapterUploads:
    """Uploads sent on to the gateway, each file within ``file_bytes`` and each body within ``body_bytes``."""

    def __init__(self, stub: image_generation_pb2_grpc.ImageGenerationStub, file_bytes: int, body_bytes: int) -> None:
        self.stub, self.file_bytes, self.body_bytes = stub, file_bytes, body_bytes
        self._reading = asyncio.Semaphore(UPLOADS_AT_ONCE)

    async def upload(self, request: web.Request, metadata: list[tuple[str, str]] | None) -> pb.AdapterInfo:
        """The adapter the gateway kept; HttpError naming the parameter, or the gateway's refusal."""
        async with self._reading:
            form = _Form(request, self.file_bytes, self.body_bytes)
            call: _Call | None = None
            spooled: IO[bytes] | None = None
            try:
                while (part := await form.next()) is not None:
                    name = part.name or ""
                    if call is not None:
                        raise bad_request(
                            name[:64],
                            f"{quoted(name)} came after file, whose part declared its length and was sent on as it "
                            "came: send the fields before the file",
                        )
                    if name in FIELDS:
                        form.take(name, await form.text(part, name))
                    elif name == "file":
                        if spooled is not None:
                            raise bad_request("file", "file is given twice: an upload is one file")
                        declared = form.declared_length(part)
                        if declared is not None and "name" in form.fields:
                            call = _Call(self.stub, metadata, form.header(declared))
                            await call.send(form.chunks(part, declared))
                        else:
                            spooled, size = await form.spool(part)
                    else:
                        raise bad_request(name[:64] or "body", f"unknown parameter {quoted(name)}")
                if call is None:
                    if spooled is None:
                        raise bad_request("file", "file is required: the adapter's .safetensors file")
                    call = _Call(self.stub, metadata, form.header(size))
                    await call.send(_chunks_of(spooled))
                return await call.answer()
            except BaseException:
                if call is not None:
                    call.cancel()  # the gateway drops what it received
                raise
            finally:
                if spooled is not None:
                    await asyncio.to_thread(spooled.close)


class _Form:
    """A request's multipart form, read a part at a time within the limits."""

    def __init__(self, request: web.Request, file_bytes: int, body_bytes: int) -> None:
        self.request, self.file_bytes, self.body_bytes = request, file_bytes, body_bytes
        self.reader: MultipartReader | None = None
        self.fields: dict[str, str] = {}

    async def next(self) -> BodyPartReader | None:
        """The next part; None past the last."""
        if self.reader is None:
            if self.request.content_type != "multipart/form-data":
                raise bad_request("body", "the body must be a multipart/form-data form: file, name, base_model")
            self.reader = await _malformed_as_400(self.request.multipart())
        part = await _malformed_as_400(self.reader.next())
        self._within_body()
        if part is not None and not isinstance(part, BodyPartReader):
            raise bad_request("body", "a part of the form is itself a multipart body")
        return part

    def take(self, name: str, value: str) -> None:
        if name in self.fields:
            raise bad_request(name, f"{name} is given twice")
        self.fields[name] = value

    def header(self, size: int) -> pb.UploadAdapterRequest:
        if "name" not in self.fields:
            raise bad_request("name", "name is required: the adapter's name (letters, digits, '_' and '-')")
        upload = pb.AdapterUpload(name=self.fields["name"], base_model=self.fields.get("base_model", ""))
        upload.size_bytes = size
        return pb.UploadAdapterRequest(header=upload)

    async def read(self, part: BodyPartReader, size: int) -> bytes:
        chunk = await _malformed_as_400(part.read_chunk(size))
        self._within_body()
        return chunk

    def _within_body(self) -> None:
        # The bytes received so far, as aiohttp counts them against its own limit
        # (once decompressed, where the body declares an encoding).
        if self.request.content.total_bytes > self.body_bytes:
            raise too_large(self.body_bytes)

    async def text(self, part: BodyPartReader, name: str) -> str:
        value = b""
        while chunk := await self.read(part, FIELD_BYTES):
            value += chunk
            if len(value) > FIELD_BYTES:
                raise bad_request(name, f"{name} is longer than {FIELD_BYTES} bytes")
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise bad_request(name, f"{name} is not UTF-8 text: {quoted(value)}") from None

    def declared_length(self, part: BodyPartReader) -> int | None:
        """The file part's ``Content-Length``; 413 before a byte of it is read when over the limit."""
        text = part.headers.get("Content-Length")
        if text is None:
            return None
        if not (text.isascii() and text.isdigit() and len(text) <= 20):
            raise bad_request("file", f"file's Content-Length {quoted(text)} is not a number of bytes")
        if int(text) > self.file_bytes:
            raise file_too_large(self.file_bytes)
        return int(text)

    async def chunks(self, part: BodyPartReader, declared: int | None = None) -> AsyncIterator[bytes]:
        """The file part's bytes in chunks of CHUNK_BYTES (the last shorter); 413 once
        past the limit, 400 once past the length it declared."""
        buffer, received = bytearray(), 0
        while chunk := await self.read(part, CHUNK_BYTES):
            received += len(chunk)
            if received > self.file_bytes:
                raise file_too_large(self.file_bytes)
            if declared is not None and received > declared:
                raise bad_request("file", f"file's part is longer than its Content-Length of {declared} bytes")
            buffer += chunk
            if len(buffer) >= CHUNK_BYTES:
                yield bytes(buffer[:CHUNK_BYTES])
                del buffer[:CHUNK_BYTES]
        if buffer:
            yield bytes(buffer)

    async def spool(self, part: BodyPartReader) -> tuple[IO[bytes], int]:
        """The file part in a temporary file (gone once closed), to be read from its
        start, and its size."""
        spooled = await asyncio.to_thread(_temporary_file)
        size = 0
        try:
            async for chunk in self.chunks(part):
                await asyncio.to_thread(spooled.write, chunk)
                size += len(chunk)
            await asyncio.to_thread(spooled.seek, 0)
        except BaseException:
            await asyncio.to_thread(spooled.close)
            raise
        return spooled, size


def _temporary_file() -> IO[bytes]:
    return tempfile.TemporaryFile(prefix="darkroom-adapter-")


async def _chunks_of(spooled: IO[bytes]) -> AsyncIterator[bytes]:
    while chunk := await asyncio.to_thread(spooled.read, CHUNK_BYTES):
        yield chunk


async def _malformed_as_400(step: Awaitable[T]) -> T:
    """``step``, a read of the form; 400 naming ``body`` where the form breaks
    multipart's rules (RuntimeError: aiohttp's for a bad ``_charset_`` part)."""
    try:
        return await step
    except (ValueError, LookupError, RuntimeError, HttpProcessingError) as exc:
        raise bad_request("body", f"the body is not a form: {str(exc)[:200]}") from None


class _Call:
    """An ``UploadAdapter`` call: its header, then its chunks, each written as the gateway takes it."""

    def __init__(
        self,
        stub: image_generation_pb2_grpc.ImageGenerationStub,
        metadata: list[tuple[str, str]] | None,
        header: pb.UploadAdapterRequest,
    ) -> None:
        self.call = stub.UploadAdapter(metadata=metadata, timeout=UPLOAD_TIMEOUT_S)
        self.header = header

    async def send(self, chunks: AsyncIterator[bytes]) -> None:
        await self._write(self.header)
        # The gateway's initial metadata accepts the header; its refusal ends the call
        # instead, answered here before a byte of the file is in flight (a write that
        # meets the call's end is reported as gRPC's own INTERNAL, the refusal lost).
        await self.call.initial_metadata()
        if self.call.done():
            await self.call
        async for chunk in chunks:
            await self._write(pb.UploadAdapterRequest(chunk=chunk))

    async def _write(self, message: pb.UploadAdapterRequest) -> None:
        try:
            await self.call.write(message)
        except asyncio.InvalidStateError:  # the gateway answered before the file's end: its refusal
            await self.call
            raise

    async def answer(self) -> pb.AdapterInfo:
        await self.call.done_writing()
        return await self.call

    def cancel(self) -> None:
        self.call.cancel()
