from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeRequest(_message.Message):
    __slots__ = ("model", "latents", "shape", "dtype", "mime_type", "job_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LATENTS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    latents: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    mime_type: str
    job_id: str
    def __init__(self, model: _Optional[str] = ..., latents: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., mime_type: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("index", "offset", "data", "last", "width", "height", "mime_type")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    last: bool
    width: int
    height: int
    mime_type: str
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., mime_type: _Optional[str] = ...) -> None: ...
