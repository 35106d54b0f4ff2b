from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeJob(_message.Message):
    __slots__ = ("job_id", "images", "mime_type", "traceparent", "fps", "output_policy")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_POLICY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    images: int
    mime_type: str
    traceparent: str
    fps: float
    output_policy: str
    def __init__(self, job_id: _Optional[str] = ..., images: _Optional[int] = ..., mime_type: _Optional[str] = ..., traceparent: _Optional[str] = ..., fps: _Optional[float] = ..., output_policy: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("model", "latents", "shape", "dtype", "jobs")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LATENTS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    model: str
    latents: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    jobs: _containers.RepeatedCompositeFieldContainer[DecodeJob]
    def __init__(self, model: _Optional[str] = ..., latents: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., jobs: _Optional[_Iterable[_Union[DecodeJob, _Mapping]]] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("job", "index", "offset", "data", "last", "width", "height", "mime_type", "error", "frames", "nsfw_score", "verdict")
    JOB_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    NSFW_SCORE_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    job: int
    index: int
    offset: int
    data: bytes
    last: bool
    width: int
    height: int
    mime_type: str
    error: str
    frames: int
    nsfw_score: float
    verdict: str
    def __init__(self, job: _Optional[int] = ..., index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., mime_type: _Optional[str] = ..., error: _Optional[str] = ..., frames: _Optional[int] = ..., nsfw_score: _Optional[float] = ..., verdict: _Optional[str] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("model", "image", "width", "height", "job_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    image: bytes
    width: int
    height: int
    job_id: str
    def __init__(self, model: _Optional[str] = ..., image: _Optional[bytes] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., job_id: _Optional[str] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("latents", "shape")
    LATENTS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    latents: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, latents: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class EncodePromptRequest(_message.Message):
    __slots__ = ("model", "prompt", "negative_prompt", "guided", "width", "height", "image", "image_width", "image_height", "job_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    GUIDED_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    IMAGE_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    negative_prompt: str
    guided: bool
    width: int
    height: int
    image: bytes
    image_width: int
    image_height: int
    job_id: str
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., negative_prompt: _Optional[str] = ..., guided: _Optional[bool] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., image: _Optional[bytes] = ..., image_width: _Optional[int] = ..., image_height: _Optional[int] = ..., job_id: _Optional[str] = ...) -> None: ...

class EncodePromptResponse(_message.Message):
    __slots__ = ("conditioning", "cached")
    CONDITIONING_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    conditioning: bytes
    cached: bool
    def __init__(self, conditioning: _Optional[bytes] = ..., cached: _Optional[bool] = ...) -> None: ...
