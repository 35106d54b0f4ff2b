import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATUS_UNSPECIFIED: _ClassVar[JobStatus]
    JOB_STATUS_QUEUED: _ClassVar[JobStatus]
    JOB_STATUS_SCHEDULED: _ClassVar[JobStatus]
    JOB_STATUS_RUNNING: _ClassVar[JobStatus]
    JOB_STATUS_DECODING: _ClassVar[JobStatus]
    JOB_STATUS_SUCCEEDED: _ClassVar[JobStatus]
    JOB_STATUS_FAILED: _ClassVar[JobStatus]
    JOB_STATUS_CANCELLED: _ClassVar[JobStatus]
    JOB_STATUS_EXPIRED: _ClassVar[JobStatus]

class OutputFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_FORMAT_UNSPECIFIED: _ClassVar[OutputFormat]
    OUTPUT_FORMAT_PNG: _ClassVar[OutputFormat]
    OUTPUT_FORMAT_JPEG: _ClassVar[OutputFormat]
    OUTPUT_FORMAT_WEBP: _ClassVar[OutputFormat]
    OUTPUT_FORMAT_MP4: _ClassVar[OutputFormat]
JOB_STATUS_UNSPECIFIED: JobStatus
JOB_STATUS_QUEUED: JobStatus
JOB_STATUS_SCHEDULED: JobStatus
JOB_STATUS_RUNNING: JobStatus
JOB_STATUS_DECODING: JobStatus
JOB_STATUS_SUCCEEDED: JobStatus
JOB_STATUS_FAILED: JobStatus
JOB_STATUS_CANCELLED: JobStatus
JOB_STATUS_EXPIRED: JobStatus
OUTPUT_FORMAT_UNSPECIFIED: OutputFormat
OUTPUT_FORMAT_PNG: OutputFormat
OUTPUT_FORMAT_JPEG: OutputFormat
OUTPUT_FORMAT_WEBP: OutputFormat
OUTPUT_FORMAT_MP4: OutputFormat

class SubmitJobRequest(_message.Message):
    __slots__ = ("model", "prompt", "negative_prompt", "width", "height", "steps", "guidance_scale", "seed", "num_images", "idempotency_key", "lane", "deadline", "output_format", "frames", "fps", "image", "mask", "strength", "previews", "expand_prompt", "adapters")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    GUIDANCE_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    NUM_IMAGES_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    MASK_FIELD_NUMBER: _ClassVar[int]
    STRENGTH_FIELD_NUMBER: _ClassVar[int]
    PREVIEWS_FIELD_NUMBER: _ClassVar[int]
    EXPAND_PROMPT_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    negative_prompt: str
    width: int
    height: int
    steps: int
    guidance_scale: float
    seed: int
    num_images: int
    idempotency_key: str
    lane: str
    deadline: _timestamp_pb2.Timestamp
    output_format: OutputFormat
    frames: int
    fps: float
    image: bytes
    mask: bytes
    strength: float
    previews: int
    expand_prompt: bool
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., negative_prompt: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., steps: _Optional[int] = ..., guidance_scale: _Optional[float] = ..., seed: _Optional[int] = ..., num_images: _Optional[int] = ..., idempotency_key: _Optional[str] = ..., lane: _Optional[str] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., output_format: _Optional[_Union[OutputFormat, str]] = ..., frames: _Optional[int] = ..., fps: _Optional[float] = ..., image: _Optional[bytes] = ..., mask: _Optional[bytes] = ..., strength: _Optional[float] = ..., previews: _Optional[int] = ..., expand_prompt: _Optional[bool] = ..., adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ...) -> None: ...

class Adapter(_message.Message):
    __slots__ = ("name", "scale")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    name: str
    scale: float
    def __init__(self, name: _Optional[str] = ..., scale: _Optional[float] = ...) -> None: ...

class SubmitJobResponse(_message.Message):
    __slots__ = ("job_id", "status", "estimated_start_time", "estimated_finish_time", "deduplicated")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_START_TIME_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_FINISH_TIME_FIELD_NUMBER: _ClassVar[int]
    DEDUPLICATED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    status: JobStatus
    estimated_start_time: _timestamp_pb2.Timestamp
    estimated_finish_time: _timestamp_pb2.Timestamp
    deduplicated: bool
    def __init__(self, job_id: _Optional[str] = ..., status: _Optional[_Union[JobStatus, str]] = ..., estimated_start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., estimated_finish_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., deduplicated: _Optional[bool] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("step", "total")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    step: int
    total: int
    def __init__(self, step: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class StageTimings(_message.Message):
    __slots__ = ("created_time", "scheduled_time", "started_time", "decoding_time", "finished_time", "dispatched_time", "decoded_time")
    CREATED_TIME_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_TIME_FIELD_NUMBER: _ClassVar[int]
    STARTED_TIME_FIELD_NUMBER: _ClassVar[int]
    DECODING_TIME_FIELD_NUMBER: _ClassVar[int]
    FINISHED_TIME_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_TIME_FIELD_NUMBER: _ClassVar[int]
    DECODED_TIME_FIELD_NUMBER: _ClassVar[int]
    created_time: _timestamp_pb2.Timestamp
    scheduled_time: _timestamp_pb2.Timestamp
    started_time: _timestamp_pb2.Timestamp
    decoding_time: _timestamp_pb2.Timestamp
    finished_time: _timestamp_pb2.Timestamp
    dispatched_time: _timestamp_pb2.Timestamp
    decoded_time: _timestamp_pb2.Timestamp
    def __init__(self, created_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., scheduled_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., started_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., decoding_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., dispatched_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., decoded_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class StageDurations(_message.Message):
    __slots__ = ("queue_seconds", "schedule_seconds", "dispatch_seconds", "sample_seconds", "decode_seconds", "store_seconds", "total_seconds")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    schedule_seconds: float
    dispatch_seconds: float
    sample_seconds: float
    decode_seconds: float
    store_seconds: float
    total_seconds: float
    def __init__(self, queue_seconds: _Optional[float] = ..., schedule_seconds: _Optional[float] = ..., dispatch_seconds: _Optional[float] = ..., sample_seconds: _Optional[float] = ..., decode_seconds: _Optional[float] = ..., store_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data", "mime_type", "width", "height", "seed", "frames", "fps", "nsfw_score", "verdict")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    NSFW_SCORE_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    width: int
    height: int
    seed: int
    frames: int
    fps: float
    nsfw_score: float
    verdict: str
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., seed: _Optional[int] = ..., frames: _Optional[int] = ..., fps: _Optional[float] = ..., nsfw_score: _Optional[float] = ..., verdict: _Optional[str] = ...) -> None: ...

class RoutingCandidate(_message.Message):
    __slots__ = ("worker_id", "score_seconds", "eligible", "note")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ELIGIBLE_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    score_seconds: float
    eligible: bool
    note: str
    def __init__(self, worker_id: _Optional[str] = ..., score_seconds: _Optional[float] = ..., eligible: _Optional[bool] = ..., note: _Optional[str] = ...) -> None: ...

class Routing(_message.Message):
    __slots__ = ("worker_id", "reason", "candidates")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    CANDIDATES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    reason: str
    candidates: _containers.RepeatedCompositeFieldContainer[RoutingCandidate]
    def __init__(self, worker_id: _Optional[str] = ..., reason: _Optional[str] = ..., candidates: _Optional[_Iterable[_Union[RoutingCandidate, _Mapping]]] = ...) -> None: ...

class AttemptFailure(_message.Message):
    __slots__ = ("attempt", "worker_id", "error")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    worker_id: str
    error: str
    def __init__(self, attempt: _Optional[int] = ..., worker_id: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class Suspension(_message.Message):
    __slots__ = ("attempt", "worker_id", "step", "total", "reason", "time")
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    attempt: int
    worker_id: str
    step: int
    total: int
    reason: str
    time: _timestamp_pb2.Timestamp
    def __init__(self, attempt: _Optional[int] = ..., worker_id: _Optional[str] = ..., step: _Optional[int] = ..., total: _Optional[int] = ..., reason: _Optional[str] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "status", "model", "prompt", "width", "height", "steps", "num_images", "progress", "timings", "worker_id", "attempts", "error", "routing", "images", "lane", "deadline", "failed_attempts", "starts", "output_format", "batch_images", "stage_durations", "checkpoint_step", "suspensions", "resumptions", "gpu_seconds", "credits_reserved", "credits_charged", "frames", "fps", "strength", "task", "waiting_for", "expanded_prompt", "output_policy", "joined_batch_images", "adapters", "cached_steps")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_IMAGES_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    FAILED_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    STARTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    BATCH_IMAGES_FIELD_NUMBER: _ClassVar[int]
    STAGE_DURATIONS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    SUSPENSIONS_FIELD_NUMBER: _ClassVar[int]
    RESUMPTIONS_FIELD_NUMBER: _ClassVar[int]
    GPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CREDITS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    CREDITS_CHARGED_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    STRENGTH_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    EXPANDED_PROMPT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_POLICY_FIELD_NUMBER: _ClassVar[int]
    JOINED_BATCH_IMAGES_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    CACHED_STEPS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    status: JobStatus
    model: str
    prompt: str
    width: int
    height: int
    steps: int
    num_images: int
    progress: Progress
    timings: StageTimings
    worker_id: str
    attempts: int
    error: str
    routing: Routing
    images: _containers.RepeatedCompositeFieldContainer[Image]
    lane: str
    deadline: _timestamp_pb2.Timestamp
    failed_attempts: _containers.RepeatedCompositeFieldContainer[AttemptFailure]
    starts: int
    output_format: OutputFormat
    batch_images: int
    stage_durations: StageDurations
    checkpoint_step: int
    suspensions: _containers.RepeatedCompositeFieldContainer[Suspension]
    resumptions: _containers.RepeatedCompositeFieldContainer[Suspension]
    gpu_seconds: float
    credits_reserved: float
    credits_charged: float
    frames: int
    fps: float
    strength: float
    task: str
    waiting_for: str
    expanded_prompt: str
    output_policy: str
    joined_batch_images: int
    adapters: _containers.RepeatedCompositeFieldContainer[Adapter]
    cached_steps: int
    def __init__(self, job_id: _Optional[str] = ..., status: _Optional[_Union[JobStatus, str]] = ..., model: _Optional[str] = ..., prompt: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., steps: _Optional[int] = ..., num_images: _Optional[int] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., worker_id: _Optional[str] = ..., attempts: _Optional[int] = ..., error: _Optional[str] = ..., routing: _Optional[_Union[Routing, _Mapping]] = ..., images: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., lane: _Optional[str] = ..., deadline: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., failed_attempts: _Optional[_Iterable[_Union[AttemptFailure, _Mapping]]] = ..., starts: _Optional[int] = ..., output_format: _Optional[_Union[OutputFormat, str]] = ..., batch_images: _Optional[int] = ..., stage_durations: _Optional[_Union[StageDurations, _Mapping]] = ..., checkpoint_step: _Optional[int] = ..., suspensions: _Optional[_Iterable[_Union[Suspension, _Mapping]]] = ..., resumptions: _Optional[_Iterable[_Union[Suspension, _Mapping]]] = ..., gpu_seconds: _Optional[float] = ..., credits_reserved: _Optional[float] = ..., credits_charged: _Optional[float] = ..., frames: _Optional[int] = ..., fps: _Optional[float] = ..., strength: _Optional[float] = ..., task: _Optional[str] = ..., waiting_for: _Optional[str] = ..., expanded_prompt: _Optional[str] = ..., output_policy: _Optional[str] = ..., joined_batch_images: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[Adapter, _Mapping]]] = ..., cached_steps: _Optional[int] = ...) -> None: ...

class StreamJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ImageChunk(_message.Message):
    __slots__ = ("index", "offset", "data", "last", "mime_type", "width", "height", "seed", "frames", "fps", "nsfw_score", "verdict")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    NSFW_SCORE_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    last: bool
    mime_type: str
    width: int
    height: int
    seed: int
    frames: int
    fps: float
    nsfw_score: float
    verdict: str
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ..., mime_type: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ..., seed: _Optional[int] = ..., frames: _Optional[int] = ..., fps: _Optional[float] = ..., nsfw_score: _Optional[float] = ..., verdict: _Optional[str] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("job_id", "status", "progress", "image_chunk", "terminal", "suspended", "resumed", "preview")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_CHUNK_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_FIELD_NUMBER: _ClassVar[int]
    SUSPENDED_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    PREVIEW_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    status: JobStatus
    progress: Progress
    image_chunk: ImageChunk
    terminal: Job
    suspended: Suspension
    resumed: Suspension
    preview: Preview
    def __init__(self, job_id: _Optional[str] = ..., status: _Optional[_Union[JobStatus, str]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., image_chunk: _Optional[_Union[ImageChunk, _Mapping]] = ..., terminal: _Optional[_Union[Job, _Mapping]] = ..., suspended: _Optional[_Union[Suspension, _Mapping]] = ..., resumed: _Optional[_Union[Suspension, _Mapping]] = ..., preview: _Optional[_Union[Preview, _Mapping]] = ...) -> None: ...

class Preview(_message.Message):
    __slots__ = ("step", "total", "index", "data", "mime_type", "width", "height")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    step: int
    total: int
    index: int
    data: bytes
    mime_type: str
    width: int
    height: int
    def __init__(self, step: _Optional[int] = ..., total: _Optional[int] = ..., index: _Optional[int] = ..., data: _Optional[bytes] = ..., mime_type: _Optional[str] = ..., width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class CancelJobResponse(_message.Message):
    __slots__ = ("job_id", "status")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    status: JobStatus
    def __init__(self, job_id: _Optional[str] = ..., status: _Optional[_Union[JobStatus, str]] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "statuses")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    statuses: _containers.RepeatedScalarFieldContainer[JobStatus]
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., statuses: _Optional[_Iterable[_Union[JobStatus, str]]] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "next_page_token")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    next_page_token: str
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "family", "max_width", "max_height", "max_steps", "default_steps", "warm_on", "capability", "is_default", "size_step", "default_width", "default_height", "max_images", "max_frames", "default_frames", "frames_step", "default_fps", "edits", "served_by", "adapters_per_job", "adapter_rank")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    MAX_WIDTH_FIELD_NUMBER: _ClassVar[int]
    MAX_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_STEPS_FIELD_NUMBER: _ClassVar[int]
    WARM_ON_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    SIZE_STEP_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_WIDTH_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_HEIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FRAMES_STEP_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_FPS_FIELD_NUMBER: _ClassVar[int]
    EDITS_FIELD_NUMBER: _ClassVar[int]
    SERVED_BY_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_PER_JOB_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    family: str
    max_width: int
    max_height: int
    max_steps: int
    default_steps: int
    warm_on: _containers.RepeatedScalarFieldContainer[str]
    capability: str
    is_default: bool
    size_step: int
    default_width: int
    default_height: int
    max_images: int
    max_frames: int
    default_frames: int
    frames_step: int
    default_fps: float
    edits: bool
    served_by: _containers.RepeatedScalarFieldContainer[str]
    adapters_per_job: int
    adapter_rank: int
    def __init__(self, name: _Optional[str] = ..., family: _Optional[str] = ..., max_width: _Optional[int] = ..., max_height: _Optional[int] = ..., max_steps: _Optional[int] = ..., default_steps: _Optional[int] = ..., warm_on: _Optional[_Iterable[str]] = ..., capability: _Optional[str] = ..., is_default: _Optional[bool] = ..., size_step: _Optional[int] = ..., default_width: _Optional[int] = ..., default_height: _Optional[int] = ..., max_images: _Optional[int] = ..., max_frames: _Optional[int] = ..., default_frames: _Optional[int] = ..., frames_step: _Optional[int] = ..., default_fps: _Optional[float] = ..., edits: _Optional[bool] = ..., served_by: _Optional[_Iterable[str]] = ..., adapters_per_job: _Optional[int] = ..., adapter_rank: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "available", "processing", "completed", "average_seconds", "estimated_load_seconds", "errors", "temperature_c", "vram_used_bytes", "vram_total_bytes", "device", "warm_models", "restarts", "state", "kind", "telemetry_source", "telemetry_note", "utilization_pct", "memory_utilization_pct", "power_w", "power_limit_w", "sm_clock_mhz", "max_sm_clock_mhz", "throttle_reasons", "queued_images", "capabilities", "running_jobs", "denoise_busy_ratio", "denoising_seconds", "work_waiting_seconds", "denoised_batches", "host_gap_seconds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    PROCESSING_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    VRAM_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    VRAM_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WARM_MODELS_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_SOURCE_FIELD_NUMBER: _ClassVar[int]
    TELEMETRY_NOTE_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_PCT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_UTILIZATION_PCT_FIELD_NUMBER: _ClassVar[int]
    POWER_W_FIELD_NUMBER: _ClassVar[int]
    POWER_LIMIT_W_FIELD_NUMBER: _ClassVar[int]
    SM_CLOCK_MHZ_FIELD_NUMBER: _ClassVar[int]
    MAX_SM_CLOCK_MHZ_FIELD_NUMBER: _ClassVar[int]
    THROTTLE_REASONS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_IMAGES_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_JOBS_FIELD_NUMBER: _ClassVar[int]
    DENOISE_BUSY_RATIO_FIELD_NUMBER: _ClassVar[int]
    DENOISING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORK_WAITING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DENOISED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    HOST_GAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    available: bool
    processing: int
    completed: int
    average_seconds: float
    estimated_load_seconds: float
    errors: int
    temperature_c: float
    vram_used_bytes: int
    vram_total_bytes: int
    device: str
    warm_models: _containers.RepeatedScalarFieldContainer[str]
    restarts: int
    state: str
    kind: str
    telemetry_source: str
    telemetry_note: str
    utilization_pct: float
    memory_utilization_pct: float
    power_w: float
    power_limit_w: float
    sm_clock_mhz: int
    max_sm_clock_mhz: int
    throttle_reasons: _containers.RepeatedScalarFieldContainer[str]
    queued_images: int
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    running_jobs: _containers.RepeatedScalarFieldContainer[str]
    denoise_busy_ratio: float
    denoising_seconds: float
    work_waiting_seconds: float
    denoised_batches: int
    host_gap_seconds: float
    def __init__(self, worker_id: _Optional[str] = ..., available: _Optional[bool] = ..., processing: _Optional[int] = ..., completed: _Optional[int] = ..., average_seconds: _Optional[float] = ..., estimated_load_seconds: _Optional[float] = ..., errors: _Optional[int] = ..., temperature_c: _Optional[float] = ..., vram_used_bytes: _Optional[int] = ..., vram_total_bytes: _Optional[int] = ..., device: _Optional[str] = ..., warm_models: _Optional[_Iterable[str]] = ..., restarts: _Optional[int] = ..., state: _Optional[str] = ..., kind: _Optional[str] = ..., telemetry_source: _Optional[str] = ..., telemetry_note: _Optional[str] = ..., utilization_pct: _Optional[float] = ..., memory_utilization_pct: _Optional[float] = ..., power_w: _Optional[float] = ..., power_limit_w: _Optional[float] = ..., sm_clock_mhz: _Optional[int] = ..., max_sm_clock_mhz: _Optional[int] = ..., throttle_reasons: _Optional[_Iterable[str]] = ..., queued_images: _Optional[int] = ..., capabilities: _Optional[_Iterable[str]] = ..., running_jobs: _Optional[_Iterable[str]] = ..., denoise_busy_ratio: _Optional[float] = ..., denoising_seconds: _Optional[float] = ..., work_waiting_seconds: _Optional[float] = ..., denoised_batches: _Optional[int] = ..., host_gap_seconds: _Optional[float] = ...) -> None: ...

class GlobalStats(_message.Message):
    __slots__ = ("requests", "queued", "completed", "failed", "running", "cancelled", "expired")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    requests: int
    queued: int
    completed: int
    failed: int
    running: int
    cancelled: int
    expired: int
    def __init__(self, requests: _Optional[int] = ..., queued: _Optional[int] = ..., completed: _Optional[int] = ..., failed: _Optional[int] = ..., running: _Optional[int] = ..., cancelled: _Optional[int] = ..., expired: _Optional[int] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("tenant", "lane", "queued", "running", "credits", "daily_credits", "gpu_seconds_today", "credits_today")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    CREDITS_FIELD_NUMBER: _ClassVar[int]
    DAILY_CREDITS_FIELD_NUMBER: _ClassVar[int]
    GPU_SECONDS_TODAY_FIELD_NUMBER: _ClassVar[int]
    CREDITS_TODAY_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    lane: str
    queued: int
    running: int
    credits: float
    daily_credits: float
    gpu_seconds_today: float
    credits_today: float
    def __init__(self, tenant: _Optional[str] = ..., lane: _Optional[str] = ..., queued: _Optional[int] = ..., running: _Optional[int] = ..., credits: _Optional[float] = ..., daily_credits: _Optional[float] = ..., gpu_seconds_today: _Optional[float] = ..., credits_today: _Optional[float] = ...) -> None: ...

class LaneQueue(_message.Message):
    __slots__ = ("lane", "queued", "held", "oldest_queued_seconds")
    LANE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    OLDEST_QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lane: str
    queued: int
    held: int
    oldest_queued_seconds: float
    def __init__(self, lane: _Optional[str] = ..., queued: _Optional[int] = ..., held: _Optional[int] = ..., oldest_queued_seconds: _Optional[float] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("workers", "totals", "usage", "lanes")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LANES_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    totals: GlobalStats
    usage: TenantUsage
    lanes: _containers.RepeatedCompositeFieldContainer[LaneQueue]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., totals: _Optional[_Union[GlobalStats, _Mapping]] = ..., usage: _Optional[_Union[TenantUsage, _Mapping]] = ..., lanes: _Optional[_Iterable[_Union[LaneQueue, _Mapping]]] = ...) -> None: ...

class ModerationInput(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: bytes
    def __init__(self, text: _Optional[str] = ..., image: _Optional[bytes] = ...) -> None: ...

class ModerateRequest(_message.Message):
    __slots__ = ("inputs",)
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[ModerationInput]
    def __init__(self, inputs: _Optional[_Iterable[_Union[ModerationInput, _Mapping]]] = ...) -> None: ...

class ModerationResult(_message.Message):
    __slots__ = ("flagged", "categories", "category_scores")
    class CategoriesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bool
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bool] = ...) -> None: ...
    class CategoryScoresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    FLAGGED_FIELD_NUMBER: _ClassVar[int]
    CATEGORIES_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_SCORES_FIELD_NUMBER: _ClassVar[int]
    flagged: bool
    categories: _containers.ScalarMap[str, bool]
    category_scores: _containers.ScalarMap[str, float]
    def __init__(self, flagged: _Optional[bool] = ..., categories: _Optional[_Mapping[str, bool]] = ..., category_scores: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ModerateResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ModerationResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ModerationResult, _Mapping]]] = ...) -> None: ...

class UploadAdapterRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: AdapterUpload
    chunk: bytes
    def __init__(self, header: _Optional[_Union[AdapterUpload, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class AdapterUpload(_message.Message):
    __slots__ = ("name", "base_model", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    base_model: str
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., base_model: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "version", "family", "base_model", "rank", "layers", "size_bytes", "own", "published", "created_time", "skipped")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OWN_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    CREATED_TIME_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    family: str
    base_model: str
    rank: int
    layers: int
    size_bytes: int
    own: bool
    published: bool
    created_time: _timestamp_pb2.Timestamp
    skipped: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., family: _Optional[str] = ..., base_model: _Optional[str] = ..., rank: _Optional[int] = ..., layers: _Optional[int] = ..., size_bytes: _Optional[int] = ..., own: _Optional[bool] = ..., published: _Optional[bool] = ..., created_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., skipped: _Optional[_Iterable[str]] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdapterQuota(_message.Message):
    __slots__ = ("adapters", "max_adapters", "size_bytes", "max_size_bytes")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    adapters: int
    max_adapters: int
    size_bytes: int
    max_size_bytes: int
    def __init__(self, adapters: _Optional[int] = ..., max_adapters: _Optional[int] = ..., size_bytes: _Optional[int] = ..., max_size_bytes: _Optional[int] = ...) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters", "quota")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    QUOTA_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    quota: AdapterQuota
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ..., quota: _Optional[_Union[AdapterQuota, _Mapping]] = ...) -> None: ...

class DeleteAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteAdapterResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, removed: _Optional[_Iterable[str]] = ...) -> None: ...
