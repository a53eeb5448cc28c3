from proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WarmRequest(_message.Message):
    __slots__ = ("ctx", "keys", "prompt_tokens")
    CTX_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ctx: _common_pb2.RequestContext
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    prompt_tokens: int
    def __init__(self, ctx: _Optional[_Union[_common_pb2.RequestContext, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

class WarmResponse(_message.Message):
    __slots__ = ("matched_blocks", "in_g2_blocks", "promoted_blocks")
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    IN_G2_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    matched_blocks: int
    in_g2_blocks: int
    promoted_blocks: int
    def __init__(self, matched_blocks: _Optional[int] = ..., in_g2_blocks: _Optional[int] = ..., promoted_blocks: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("ctx", "keys", "prompt_tokens", "touch")
    CTX_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOUCH_FIELD_NUMBER: _ClassVar[int]
    ctx: _common_pb2.RequestContext
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    prompt_tokens: int
    touch: bool
    def __init__(self, ctx: _Optional[_Union[_common_pb2.RequestContext, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., prompt_tokens: _Optional[int] = ..., touch: _Optional[bool] = ...) -> None: ...

class TierMatch(_message.Message):
    __slots__ = ("tier", "blocks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    blocks: int
    def __init__(self, tier: _Optional[str] = ..., blocks: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("matched_blocks", "usable_tokens", "tiers", "block_tiers", "lookup_s")
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USABLE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TIERS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_S_FIELD_NUMBER: _ClassVar[int]
    matched_blocks: int
    usable_tokens: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierMatch]
    block_tiers: _containers.RepeatedScalarFieldContainer[str]
    lookup_s: float
    def __init__(self, matched_blocks: _Optional[int] = ..., usable_tokens: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierMatch, _Mapping]]] = ..., block_tiers: _Optional[_Iterable[str]] = ..., lookup_s: _Optional[float] = ...) -> None: ...

class BlockHeader(_message.Message):
    __slots__ = ("key", "size", "token_count", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    size: int
    token_count: int
    checksum: bytes
    def __init__(self, key: _Optional[bytes] = ..., size: _Optional[int] = ..., token_count: _Optional[int] = ..., checksum: _Optional[bytes] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("ctx", "layout", "blocks", "shm_name", "shm_offset")
    CTX_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    ctx: _common_pb2.RequestContext
    layout: str
    blocks: _containers.RepeatedCompositeFieldContainer[BlockHeader]
    shm_name: str
    shm_offset: int
    def __init__(self, ctx: _Optional[_Union[_common_pb2.RequestContext, _Mapping]] = ..., layout: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[BlockHeader, _Mapping]]] = ..., shm_name: _Optional[str] = ..., shm_offset: _Optional[int] = ...) -> None: ...

class PutChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored_blocks", "skipped_blocks", "bytes")
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    stored_blocks: int
    skipped_blocks: int
    bytes: int
    def __init__(self, stored_blocks: _Optional[int] = ..., skipped_blocks: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("ctx", "keys", "use_shm", "max_chunk_bytes")
    CTX_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    USE_SHM_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ctx: _common_pb2.RequestContext
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    use_shm: bool
    max_chunk_bytes: int
    def __init__(self, ctx: _Optional[_Union[_common_pb2.RequestContext, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ..., use_shm: _Optional[bool] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class GetChunk(_message.Message):
    __slots__ = ("header", "data", "shm_name", "shm_offset", "missing", "shm_valid_until", "shm_reuse_gen", "more")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    SHM_VALID_UNTIL_FIELD_NUMBER: _ClassVar[int]
    SHM_REUSE_GEN_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    header: BlockHeader
    data: bytes
    shm_name: str
    shm_offset: int
    missing: bool
    shm_valid_until: float
    shm_reuse_gen: int
    more: _containers.RepeatedCompositeFieldContainer[GetChunk]
    def __init__(self, header: _Optional[_Union[BlockHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., shm_name: _Optional[str] = ..., shm_offset: _Optional[int] = ..., missing: _Optional[bool] = ..., shm_valid_until: _Optional[float] = ..., shm_reuse_gen: _Optional[int] = ..., more: _Optional[_Iterable[_Union[GetChunk, _Mapping]]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("ctx", "keys")
    CTX_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ctx: _common_pb2.RequestContext
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, ctx: _Optional[_Union[_common_pb2.RequestContext, _Mapping]] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageRequest(_message.Message):
    __slots__ = ("ctx", "min_bytes")
    CTX_FIELD_NUMBER: _ClassVar[int]
    MIN_BYTES_FIELD_NUMBER: _ClassVar[int]
    ctx: _common_pb2.RequestContext
    min_bytes: int
    def __init__(self, ctx: _Optional[_Union[_common_pb2.RequestContext, _Mapping]] = ..., min_bytes: _Optional[int] = ...) -> None: ...

class StageResponse(_message.Message):
    __slots__ = ("shm_name", "size")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    size: int
    def __init__(self, shm_name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "blocks", "hits", "misses", "evictions", "checksum_failures")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    hits: int
    misses: int
    evictions: int
    checksum_failures: int
    def __init__(self, tier: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., checksum_failures: _Optional[int] = ...) -> None: ...

class ClassStats(_message.Message):
    __slots__ = ("traffic_class", "ttl_s", "hits", "misses", "blocks")
    TRAFFIC_CLASS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    traffic_class: str
    ttl_s: int
    hits: int
    misses: int
    blocks: int
    def __init__(self, traffic_class: _Optional[str] = ..., ttl_s: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tier", "tenant", "used_bytes", "blocks", "quota_bytes", "evictions")
    TIER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    tenant: str
    used_bytes: int
    blocks: int
    quota_bytes: int
    evictions: int
    def __init__(self, tier: _Optional[str] = ..., tenant: _Optional[str] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., quota_bytes: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("node", "tiers", "classes", "whatif_json", "shm_capable", "hostname", "tenants", "tenant_names", "max_tenants")
    NODE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    CLASSES_FIELD_NUMBER: _ClassVar[int]
    WHATIF_JSON_FIELD_NUMBER: _ClassVar[int]
    SHM_CAPABLE_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    TENANT_NAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_TENANTS_FIELD_NUMBER: _ClassVar[int]
    node: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    classes: _containers.RepeatedCompositeFieldContainer[ClassStats]
    whatif_json: str
    shm_capable: bool
    hostname: str
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    tenant_names: int
    max_tenants: int
    def __init__(self, node: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., classes: _Optional[_Iterable[_Union[ClassStats, _Mapping]]] = ..., whatif_json: _Optional[str] = ..., shm_capable: _Optional[bool] = ..., hostname: _Optional[str] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., tenant_names: _Optional[int] = ..., max_tenants: _Optional[int] = ...) -> None: ...

class SetQuotaRequest(_message.Message):
    __slots__ = ("tenant", "tier", "quota_bytes", "reset")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    tier: str
    quota_bytes: int
    reset: bool
    def __init__(self, tenant: _Optional[str] = ..., tier: _Optional[str] = ..., quota_bytes: _Optional[int] = ..., reset: _Optional[bool] = ...) -> None: ...

class GetQuotasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class QuotaEntry(_message.Message):
    __slots__ = ("tier", "tenant", "quota_bytes", "source")
    TIER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    tier: str
    tenant: str
    quota_bytes: int
    source: str
    def __init__(self, tier: _Optional[str] = ..., tenant: _Optional[str] = ..., quota_bytes: _Optional[int] = ..., source: _Optional[str] = ...) -> None: ...

class QuotaResponse(_message.Message):
    __slots__ = ("quotas",)
    QUOTAS_FIELD_NUMBER: _ClassVar[int]
    quotas: _containers.RepeatedCompositeFieldContainer[QuotaEntry]
    def __init__(self, quotas: _Optional[_Iterable[_Union[QuotaEntry, _Mapping]]] = ...) -> None: ...
