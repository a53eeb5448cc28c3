"""Session affinity: a returning session goes back to the prefill instance that
served its previous turn, where its prefix still sits in G1.

A client names its session in the ``X-Session-Affinity`` header (AIPerf's
agentic loaders, llm-d and Dynamo send it; ``X-Session-Id`` is accepted too) or
in a ``session_id`` body field. The name only steers placement: it is scoped by
the tenant (one tenant's names never steer another's requests), bounded in
length and character set, and never reaches a prompt. The map is a bounded LRU,
so a client inventing names cannot grow the router's memory.

Placement stays load-aware: ``router.placement.Placer`` keeps the session's
instance only while its pending work is within ``slack_tokens`` of the least
loaded candidate (llm-d's "sticky unless overloaded").
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from router.errors import InvalidRequestError

SESSION_HEADERS = ("X-Session-Affinity", "X-Session-Id")
SESSION_FIELD = "session_id"
_NAME = re.compile(r"[\x21-\x7e]{1,256}")      # printable ASCII, no spaces


def session_from(headers: Mapping[str, str], body: object) -> str:
    """The request's session name ("" when it names none); a malformed one is a 400."""
    given, where = "", ""
    for name in SESSION_HEADERS:
        if headers.get(name):
            given, where = headers[name].strip(), name
            break
    if not given and isinstance(body, dict) and body.get(SESSION_FIELD) is not None:
        raw = body[SESSION_FIELD]
        if not isinstance(raw, str | int) or isinstance(raw, bool):
            raise InvalidRequestError(f"{SESSION_FIELD} must be a string", param=SESSION_FIELD)
        given, where = str(raw), SESSION_FIELD
    if given and not _NAME.fullmatch(given):
        raise InvalidRequestError(f"{where} must be 1-256 printable ASCII characters without "
                                  "spaces", param=where, code="invalid_session")
    return given


@dataclass(frozen=True, slots=True)
class SessionConfig:
    max_sessions: int = 100_000     # LRU bound
    slack_tokens: int = 4096        # keep the session's instance while its pending work
                                    # exceeds the least loaded one's by at most this

    def __post_init__(self) -> None:
        if self.max_sessions < 1 or self.slack_tokens < 0:
            raise ValueError("SessionConfig: max_sessions must be >= 1, slack_tokens >= 0")


class SessionMap:
    """(tenant, session) -> the prefill instance that served it last (bounded LRU)."""

    def __init__(self, cfg: SessionConfig | None = None) -> None:
        self.cfg = cfg or SessionConfig()
        self._where: OrderedDict[tuple[str, str], str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def get(self, tenant: str, session: str) -> str:
        if not session:
            return ""
        key = (tenant, session)
        found = self._where.get(key, "")
        if found:
            self._where.move_to_end(key)
        return found

    def record(self, tenant: str, session: str, instance_id: str) -> None:
        if not session:
            return
        key = (tenant, session)
        self._where[key] = instance_id
        self._where.move_to_end(key)
        while len(self._where) > self.cfg.max_sessions:
            self._where.popitem(last=False)

    def forget_instance(self, instance_id: str) -> None:
        """An instance left: its sessions are placed afresh (by cache and load)."""
        for key in [k for k, v in self._where.items() if v == instance_id]:
            del self._where[key]


class DecodeAnchors:
    """Which decode instance holds a prompt's prefix in its own G1.

    A decode instance keeps every finished turn's blocks (prompt and answer) in
    G1 and pulls only what follows them (docs/services.md, "Only the tail of a
    returning session"), so a returning conversation is cheapest where its
    previous turn was decoded. The router records every full-block chain key
    of each placed prompt (tenant-salted: one tenant's keys never match
    another's) against its decode instance; a new prompt's keys, walked from
    the end, find the longest recorded prefix. Every key, not only the last:
    agent turns often branch off inside the previous prompt (a rewritten last
    message, a subagent, a compaction), and what they share is still in that
    instance's G1. Works with or without session names. A bounded LRU of
    keys, like ``SessionMap``."""

    def __init__(self, max_keys: int = 100_000) -> None:
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1, got {max_keys}")
        self._max = max_keys
        self._where: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._where)

    def find(self, keys: Sequence[bytes]) -> tuple[str, int]:
        """(instance, leading blocks it holds) for the longest recorded prefix of
        ``keys``; ("", 0) when none is recorded."""
        for n in range(len(keys), 0, -1):
            where = self._where.get(keys[n - 1])
            if where:
                self._where.move_to_end(keys[n - 1])
                return where, n
        return "", 0

    def record(self, keys: Sequence[bytes], instance_id: str) -> None:
        # Past the bound only the prompt's last keys are kept: the longest prefix.
        for key in keys[-self._max:]:
            self._where[key] = instance_id
            self._where.move_to_end(key)
        while len(self._where) > self._max:
            self._where.popitem(last=False)

    def forget_instance(self, instance_id: str) -> None:
        for key in [k for k, v in self._where.items() if v == instance_id]:
            del self._where[key]
