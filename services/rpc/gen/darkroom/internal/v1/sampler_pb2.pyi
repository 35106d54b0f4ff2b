from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplerStage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAMPLER_STAGE_UNSPECIFIED: _ClassVar[SamplerStage]
    SAMPLER_STAGE_RUNNING: _ClassVar[SamplerStage]
    SAMPLER_STAGE_DECODING: _ClassVar[SamplerStage]
SAMPLER_STAGE_UNSPECIFIED: SamplerStage
SAMPLER_STAGE_RUNNING: SamplerStage
SAMPLER_STAGE_DECODING: SamplerStage

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class SamplerOutputChunk(_message.Message):
    __slots__ = ("index", "offset", "data", "last", "mime_type", "width", "height", "seed")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    last: bool
    mime_type: str
    width: int
    height: int
    seed: int
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., mime_type: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class SamplerEvent(_message.Message):
    __slots__ = ("job_id", "attempt", "stage", "progress", "output", "finished")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    attempt: int
    stage: SamplerStage
    progress: SamplerProgress
    output: SamplerOutputChunk
    finished: bool
    def __init__(self, job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., stage: _Optional[_Union[SamplerStage, str]] = ..., progress: _Optional[_Union[SamplerProgress, _Mapping]] = ..., output: _Optional[_Union[SamplerOutputChunk, _Mapping]] = ..., finished: _Optional[bool] = ...) -> None: ...

class SamplerProgress(_message.Message):
    __slots__ = ("step", "total")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    step: int
    total: int
    def __init__(self, step: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class SamplerCancelRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class SamplerCancelResponse(_message.Message):
    __slots__ = ("was_running",)
    WAS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    was_running: bool
    def __init__(self, was_running: _Optional[bool] = ...) -> None: ...
