from proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("ctx", "token_ids", "messages", "prompt", "sampling")
    CTX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ctx: _common_pb2.RequestContext
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    prompt: str
    sampling: _common_pb2.SamplingParams
    def __init__(self, ctx: _Optional[_Union[_common_pb2.RequestContext, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., prompt: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("ctx", "prefill_address", "prompt_ids", "block_keys", "first_token", "cached_tokens", "expires_at", "layout", "timings", "written_tiers", "fetch_decision", "kv_seed")
    CTX_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_TIERS_FIELD_NUMBER: _ClassVar[int]
    FETCH_DECISION_FIELD_NUMBER: _ClassVar[int]
    KV_SEED_FIELD_NUMBER: _ClassVar[int]
    ctx: _common_pb2.RequestContext
    prefill_address: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    block_keys: _containers.RepeatedScalarFieldContainer[bytes]
    first_token: int
    cached_tokens: int
    expires_at: float
    layout: str
    timings: _common_pb2.Timings
    written_tiers: _containers.RepeatedScalarFieldContainer[str]
    fetch_decision: str
    kv_seed: int
    def __init__(self, ctx: _Optional[_Union[_common_pb2.RequestContext, _Mapping]] = ..., prefill_address: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., block_keys: _Optional[_Iterable[bytes]] = ..., first_token: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., expires_at: _Optional[float] = ..., layout: _Optional[str] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., written_tiers: _Optional[_Iterable[str]] = ..., fetch_decision: _Optional[str] = ..., kv_seed: _Optional[int] = ...) -> None: ...

class PullKVRequest(_message.Message):
    __slots__ = ("request_id", "use_shm", "start_token", "ipc_device", "ipc_peer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    USE_SHM_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    IPC_DEVICE_FIELD_NUMBER: _ClassVar[int]
    IPC_PEER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    use_shm: bool
    start_token: int
    ipc_device: str
    ipc_peer: str
    def __init__(self, request_id: _Optional[str] = ..., use_shm: _Optional[bool] = ..., start_token: _Optional[int] = ..., ipc_device: _Optional[str] = ..., ipc_peer: _Optional[str] = ...) -> None: ...

class CudaIpc(_message.Message):
    __slots__ = ("handle", "storage_bytes", "offset_bytes", "ref_handle", "ref_offset", "event_handle", "event_sync")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    storage_bytes: int
    offset_bytes: int
    ref_handle: bytes
    ref_offset: int
    event_handle: bytes
    event_sync: bool
    def __init__(self, handle: _Optional[bytes] = ..., storage_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., ref_handle: _Optional[bytes] = ..., ref_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync: _Optional[bool] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("start_token", "token_count", "data", "shm_name", "shm_offset", "size", "checksum", "ipc")
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    IPC_FIELD_NUMBER: _ClassVar[int]
    start_token: int
    token_count: int
    data: bytes
    shm_name: str
    shm_offset: int
    size: int
    checksum: bytes
    ipc: CudaIpc
    def __init__(self, start_token: _Optional[int] = ..., token_count: _Optional[int] = ..., data: _Optional[bytes] = ..., shm_name: _Optional[str] = ..., shm_offset: _Optional[int] = ..., size: _Optional[int] = ..., checksum: _Optional[bytes] = ..., ipc: _Optional[_Union[CudaIpc, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
