"""Session affinity: what a client may name, and placement that keeps a session
on its instance unless that one is overloaded (exact decisions, no processes)."""

from __future__ import annotations

import pytest

from kvstore.registry import InstanceInfo
from router.errors import InvalidRequestError
from router.placement import Placer, make_router_policy
from router.session import DecodeAnchors, SessionConfig, SessionMap, session_from
from router.view import CandidateSet


def _cands(pending: dict[str, int]) -> CandidateSet:
    return CandidateSet.of([InstanceInfo(instance_id=k, role="prefill", address=f"h:{i}",
                                         node="n", tokens_in_flight=v)
                            for i, (k, v) in enumerate(sorted(pending.items()))])


def test_session_names_from_header_then_body() -> None:
    assert session_from({"X-Session-Affinity": "abc"}, {"session_id": "body"}) == "abc"
    assert session_from({"X-Session-Id": "s-1"}, {}) == "s-1"
    assert session_from({}, {"session_id": "conv:7"}) == "conv:7"
    assert session_from({}, {"session_id": 42}) == "42"
    assert session_from({}, {"model": "m"}) == ""
    for bad in ({"X-Session-Affinity": "a b"}, {"X-Session-Affinity": "x" * 257}):
        with pytest.raises(InvalidRequestError):
            session_from(bad, {})
    with pytest.raises(InvalidRequestError):
        session_from({}, {"session_id": ["a"]})
    with pytest.raises(InvalidRequestError):
        session_from({}, {"session_id": "<|im_start|>\n"})


def test_map_is_scoped_by_tenant_and_bounded() -> None:
    m = SessionMap(SessionConfig(max_sessions=2))
    m.record("alice", "s", "p0")
    assert m.get("alice", "s") == "p0"
    assert m.get("bob", "s") == ""                   # another tenant's name steers nothing
    m.record("alice", "t", "p1")
    m.get("alice", "s")                              # s used last: t is the oldest now
    m.record("alice", "u", "p1")
    assert len(m) == 2 and m.get("alice", "t") == "" and m.get("alice", "s") == "p0"
    m.forget_instance("p0")
    assert m.get("alice", "s") == ""


def test_round_robin_keeps_a_session_on_its_instance() -> None:
    placer = Placer(make_router_policy("round_robin"))
    cands = _cands({"p0": 0, "p1": 0})
    # Without a session, round robin alternates; with one, every turn stays.
    free = {placer.place_prefill(cands, [], 100).instance_id for _ in range(4)}
    assert free == {"p0", "p1"}
    for _ in range(4):
        d = placer.place_prefill(cands, [], 100, sticky="p1", slack_tokens=1000)
        assert d.instance_id == "p1"
    assert d.reason in ("session_affinity", "round_robin")


def test_an_overloaded_session_instance_is_left() -> None:
    placer = Placer(make_router_policy("least_load"))
    cands = _cands({"p0": 5000, "p1": 0})
    d = placer.place_prefill(cands, [], 100, sticky="p0", slack_tokens=4096)
    assert d.instance_id == "p1"                     # 5000 pending > 0 + 4096 slack
    d = placer.place_prefill(cands, [], 100, sticky="p0", slack_tokens=6000)
    assert (d.instance_id, d.reason) == ("p0", "session_affinity")
    gone = placer.place_prefill(cands.without({"p0"}), [], 100, sticky="p0",
                                slack_tokens=6000)
    assert gone.instance_id == "p1"                  # a session's dead instance is not chosen


def test_decode_anchors_find_the_longest_recorded_prefix_and_stay_bounded() -> None:
    keys = [bytes([i]) * 16 for i in range(8)]
    a = DecodeAnchors(max_keys=4)
    assert a.find(keys) == ("", 0)
    a.record(keys[:3], "d1")
    assert a.find(keys) == ("d1", 3)
    branch = [*keys[:2], bytes([50]) * 16]       # shares two blocks, then goes its own way
    assert a.find(branch) == ("d1", 2)           # every key is recorded, not only the last
    a.record([keys[0], bytes([60]) * 16], "d2")
    assert a.find(keys) == ("d1", 3)             # the longest prefix wins
    assert a.find(keys[:1]) == ("d2", 1)         # the latest to decode a block holds it
    a.record([bytes([99]) * 16], "d3")           # bounded: the least recently used go
    assert len(a) == 4 and a.find(keys) == ("d1", 3)
    a.record(keys[:6], "d4")                     # more keys than the bound: the last kept
    assert len(a) == 4 and a.find(keys) == ("d4", 6) and a.find(keys[:2]) == ("", 0)
    a.forget_instance("d4")
    assert a.find(keys) == ("", 0) and len(a) == 0
