"""Instance registry in Redis (docs/architecture.md#redis-control-plane): every
kvstore, prefill, decode and router instance keeps a hash
``kvserve:inst:<role>:<id>`` alive by heartbeats; the hash expires ``ttl_s``
after the last one, so a crashed instance drops out without anyone deleting it.

The set ``kvserve:instances:<role>`` lists a role's ids for discovery; ids
whose hash has expired are pruned from it when an instance of that role
registers (readers never write).

The role is part of every key so that each role's Redis user may write only
its own role's entries (kvstore.redis_acl); a reader accepts an entry only when
the role it names is the role of the keys it was found under.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, fields

from kvstore.redis_conn import connect, is_cluster_url

ROLES = frozenset({"kvstore", "prefill", "decode", "router"})
_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def instances_set(role: str) -> str:
    return f"kvserve:instances:{role}"


def _inst_key(role: str, instance_id: str) -> str:
    return f"kvserve:inst:{role}:{instance_id}"


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    instance_id: str
    role: str
    address: str
    node: str = ""
    model_fingerprint: str = ""
    capacity: float = 0.0             # role-specific (bytes for kvstore, KV blocks for engines)
    load: float = 0.0                 # 0..1 utilization
    queue: int = 0                    # requests waiting
    tokens_in_flight: int = 0
    expert_imbalance: float = 1.0     # max rank load / mean rank load (MoE), 1.0 = balanced
    kv_free_tokens: int = -1          # decode: KV not reserved by its sequences (-1 unknown)
    kv_capacity_tokens: int = -1      # decode: the most KV one sequence may ever hold there
    last_heartbeat: float = 0.0       # unix seconds
    kv_events: str = ""               # a vLLM engine's native KV-event ZMQ endpoint, if any
    attestation: str = ""             # signature of the identity it names (security.attest)

    def __post_init__(self) -> None:
        if not _ID.match(self.instance_id):
            raise ValueError(
                f"instance_id {self.instance_id!r} must match [A-Za-z0-9._:-]{{1,128}}")
        if self.role not in ROLES:
            raise ValueError(f"role {self.role!r} is not one of {sorted(ROLES)}")

    def to_fields(self) -> dict[str, str]:
        return {k: str(v) for k, v in asdict(self).items()}

    @classmethod
    def from_fields(cls, raw: dict[bytes, bytes]) -> InstanceInfo:
        kw: dict[str, object] = {}
        for f in fields(cls):
            v = raw.get(f.name.encode())
            if v is None:
                continue
            s = v.decode()
            kw[f.name] = int(s) if f.type == "int" else float(s) if f.type == "float" else s
        return cls(**kw)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What a heartbeat updates; fields left None keep their last value."""

    load: float | None = None
    queue: int | None = None
    tokens_in_flight: int | None = None
    expert_imbalance: float | None = None
    capacity: float | None = None
    kv_free_tokens: int | None = None
    kv_capacity_tokens: int | None = None


class InstanceRegistry:
    def __init__(self, redis_url: str, *, ttl_s: float = 5.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self._r = connect(redis_url, socket_timeout=5.0)
        # A cluster has no transaction across slots; each key's own commands stay in order.
        self._tx = not is_cluster_url(redis_url)
        self.ttl_ms = int(ttl_s * 1000)
        self._roles: dict[str, str] = {}      # instance id -> role, of what we registered

    async def register(self, info: InstanceInfo) -> None:
        fields_ = info.to_fields()
        fields_["last_heartbeat"] = str(time.time())
        key = _inst_key(info.role, info.instance_id)
        await self._prune(info.role)
        pipe = self._r.pipeline(transaction=self._tx)
        pipe.delete(key)
        pipe.hset(key, mapping=fields_)
        pipe.pexpire(key, self.ttl_ms)
        pipe.sadd(instances_set(info.role), info.instance_id)
        await pipe.execute()
        self._roles[info.instance_id] = info.role

    async def _prune(self, role: str) -> None:
        """Drop ids of ``role`` whose hash expired (a crash skips deregister)."""
        ids = [m.decode() for m in await self._r.smembers(instances_set(role))]
        if not ids:
            return
        pipe = self._r.pipeline(transaction=False)
        for i in ids:
            pipe.exists(_inst_key(role, i))
        gone = [i for i, alive in zip(ids, await pipe.execute(), strict=True) if not alive]
        if gone:
            await self._r.srem(instances_set(role), *gone)

    async def heartbeat(self, instance_id: str, report: LoadReport | None = None) -> bool:
        """Extends the life of an instance this registry registered; False when
        it had already expired (or was never registered here): the caller should
        ``register`` again."""
        role = self._roles.get(instance_id)
        if role is None:
            return False
        key = _inst_key(role, instance_id)
        updates = {"last_heartbeat": str(time.time())}
        if report is not None:
            updates.update({k: str(v) for k, v in asdict(report).items() if v is not None})
        # Only refresh a live hash: HSET on an expired key would resurrect a
        # partial record with no role or address.
        if not await self._r.pexpire(key, self.ttl_ms):
            return False
        pipe = self._r.pipeline(transaction=self._tx)
        pipe.hset(key, mapping=updates)
        pipe.pexpire(key, self.ttl_ms)
        await pipe.execute()
        return True

    async def deregister(self, instance_id: str) -> None:
        role = self._roles.pop(instance_id, None)
        if role is None:
            return
        pipe = self._r.pipeline(transaction=self._tx)
        pipe.delete(_inst_key(role, instance_id))
        pipe.srem(instances_set(role), instance_id)
        await pipe.execute()

    async def list_instances(self, role: str | None = None) -> list[InstanceInfo]:
        """Live instances (of ``role``), sorted by id. An entry that names
        another role than the keys it sits under, or does not parse, is skipped:
        a role's Redis user can write only its own role's keys."""
        roles = sorted(ROLES) if role is None else [role]
        pipe = self._r.pipeline(transaction=False)
        for r in roles:
            pipe.smembers(instances_set(r))
        listed = [(r, m.decode(errors="replace")) for r, members in
                  zip(roles, await pipe.execute(), strict=True) for m in members]
        if not listed:
            return []
        pipe = self._r.pipeline(transaction=False)
        for r, i in listed:
            pipe.hgetall(_inst_key(r, i))
        found: list[InstanceInfo] = []
        for (r, i), raw in zip(listed, await pipe.execute(), strict=True):
            if not raw or b"role" not in raw:
                continue
            try:
                info = InstanceInfo.from_fields(raw)
            except (ValueError, UnicodeDecodeError):
                continue
            if info.role == r and info.instance_id == i:
                found.append(info)
        return sorted(found, key=lambda x: x.instance_id)

    async def close(self) -> None:
        await self._r.aclose()

    async def __aenter__(self) -> InstanceRegistry:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
