"""Trace loaders on tiny hand-made files of each format, and the real ones."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from common.traces import (
    FILE_SHIFT,
    SESSION_SHIFT,
    ClassRule,
    TraceFormatError,
    load_trace,
    merge_traces,
    rebin,
)
from tests.shared_data import shared_dir

SHARED = shared_dir() / "traces"


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mooncake_times_namespaces_and_inferred_sessions(tmp_path: Path) -> None:
    p = _jsonl(tmp_path / "mc.jsonl", [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 1500, "input_length": 700, "output_length": 7, "hash_ids": [0, 3]},
        # turn 2 of the first conversation: extends it (branches after block 1)
        {"timestamp": 3000, "input_length": 1600, "output_length": 9, "hash_ids": [0, 1, 4, 5]},
        # another new conversation on the shared system prompt: a new session
        {"timestamp": 2000, "input_length": 600, "output_length": 1, "hash_ids": [0, 6]},
    ])
    tr = load_trace(p, namespace=3)
    assert tr.block_tokens == 512 and tr.name == "mc.jsonl"
    assert [r.t for r in tr.requests] == [0.0, 1.5, 2.0, 3.0]
    assert tr.requests[0].hash_ids == tuple(3 << FILE_SHIFT | h for h in (0, 1, 2))
    s = [r.session for r in tr.requests]
    # request 2 (t=1.5) is the first to branch at block 0, so it joins session 0;
    # the one at t=2.0 branches there again: a new session; t=3.0 continues session 0.
    assert s[0] == s[1] == s[3] and s[2] != s[0]
    assert {r.traffic_class for r in tr.requests} == {"chat"}
    assert (tr.requests[0].input_length, tr.requests[0].output_length) == (1100, 5)
    assert "Mooncake" in tr.arrival_note


def test_bailian_sessions_types_and_class_rule(tmp_path: Path) -> None:
    p = _jsonl(tmp_path / "qwen_traceA_blksz_16.jsonl", [
        {"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 40,
         "output_length": 3, "type": "text", "turn": 1, "hash_ids": [10, 11, 12]},
        {"chat_id": 2, "parent_chat_id": -1, "timestamp": 1.0, "input_length": 20,
         "output_length": 3, "type": "coder", "turn": 1, "hash_ids": [20, 21]},
        {"chat_id": 3, "parent_chat_id": 1, "timestamp": 9.25, "input_length": 60,
         "output_length": 3, "type": "text", "turn": 2, "hash_ids": [10, 11, 13, 14]},
        {"chat_id": 4, "parent_chat_id": 3, "timestamp": 20.0, "input_length": 70,
         "output_length": 3, "type": "text", "turn": 3, "hash_ids": [10, 11, 13, 15, 16]},
    ])
    tr = load_trace(p, class_of="type:coder=agent", time_scale=2.0)
    assert tr.block_tokens == 16
    assert [r.t for r in tr.requests] == [1.0, 2.0, 18.5, 40.0]
    assert [r.session for r in tr.requests] == ["qwen_traceA_blksz_16:1",
                                               "qwen_traceA_blksz_16:2",
                                               "qwen_traceA_blksz_16:1",
                                               "qwen_traceA_blksz_16:1"]
    assert [r.traffic_class for r in tr.requests] == ["chat", "agent", "chat", "chat"]
    assert "time_scale=2" in tr.arrival_note
    assert len(load_trace(p, max_requests=2).requests) == 2


def _session(reqs: list[dict]) -> bytes:
    return json.dumps({"id": "x", "block_size": 64, "hash_id_scope": "local",
                       "requests": reqs}).encode()


def _agent_tar(path: Path) -> Path:
    sessions = {
        "trace_0001.json": _session([
            {"t": 0.0, "type": "n", "in": 192, "out": 5, "hash_ids": [1, 2, 3]},
            {"t": 10.0, "type": "subagent", "agent_id": "agent_001", "requests": [
                {"t": 0.0, "type": "n", "in": 64, "out": 2, "hash_ids": [50]},
                {"t": 2.5, "type": "n", "in": 128, "out": 2, "hash_ids": [50, 51]}]},
            {"t": 30.0, "type": "s", "in": 256, "out": 5, "hash_ids": [1, 2, 3, 4]}]),
        "trace_0002.json": _session([
            {"t": 0.0, "type": "n", "in": 128, "out": 5, "hash_ids": [1, 2]},
            {"t": 100.0, "type": "n", "in": 192, "out": 5, "hash_ids": [1, 2, 3]}]),
        "trace_0003.json": _session([
            {"t": 0.0, "type": "n", "in": 64, "out": 5, "hash_ids": [1]}]),
    }
    with tarfile.open(path, "w:xz") as tf:
        for name, data in sessions.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def test_agent_archive_namespaces_subagents_and_poisson_placement(tmp_path: Path) -> None:
    p = _agent_tar(tmp_path / "traces.tar.xz")
    tr = load_trace(p, seed=1, namespace=0)
    assert tr.block_tokens == 64 and len(tr.requests) == 7
    assert {r.traffic_class for r in tr.requests} == {"agent"}
    by_session: dict[str, list] = {}
    for r in tr.requests:
        by_session.setdefault(r.session, []).append(r)
    assert set(by_session) == {"trace_0001", "trace_0001/agent_001", "trace_0002", "trace_0003"}
    main, sub = by_session["trace_0001"], by_session["trace_0001/agent_001"]
    # sub-agent requests sit at parent t + sub-agent t
    assert [r.t - main[0].t for r in sub] == [10.0, 12.5]
    # local ids 1, 2, 3 of two sessions never collide; sub-agents share the parent's space
    ns = {r.session: {h >> SESSION_SHIFT for h in r.hash_ids} for r in tr.requests}
    assert ns["trace_0001"] == ns["trace_0001/agent_001"] != ns["trace_0002"]
    assert len({next(iter(v)) for v in ns.values()}) == 3
    starts = sorted(v[0].t for v in by_session.values())
    assert starts[0] == 0.0 and "Poisson" in tr.arrival_note and "seed 1" in tr.arrival_note
    # the same seed places sessions identically; another seed does not
    assert load_trace(p, seed=1, namespace=0) == tr
    assert load_trace(p, seed=2, namespace=0).requests != tr.requests
    fast = load_trace(p, seed=1, session_rate_per_s=10.0)
    assert fast.span_s < tr.span_s and "rate given" in fast.arrival_note
    two = load_trace(p, max_sessions=2, seed=4)
    assert len({r.session.split("/")[0] for r in two.requests}) == 2


def test_agent_directory_and_single_file(tmp_path: Path) -> None:
    tar = _agent_tar(tmp_path / "t.tar.xz")
    d = tmp_path / "dir"
    d.mkdir()
    with tarfile.open(tar) as tf:
        tf.extractall(d, filter="data")
    assert len(load_trace(d).requests) == 7
    one = load_trace(d / "trace_0002.json")
    assert [r.t for r in one.requests] == [0.0, 100.0]


def test_rebin_and_merge(tmp_path: Path) -> None:
    agent = load_trace(_agent_tar(tmp_path / "t.tar.xz"), namespace=1)
    coarse = rebin(agent, 128)
    pairs = list(zip(agent.requests, coarse.requests, strict=True))
    fine, r = next(p for p in pairs if len(p[0].hash_ids) == 4)
    assert r.hash_ids == (fine.hash_ids[1], fine.hash_ids[3])
    fine, r = next(p for p in pairs if len(p[0].hash_ids) == 3)    # a partial coarse tail
    assert r.hash_ids == (fine.hash_ids[1], fine.hash_ids[2])
    with pytest.raises(ValueError, match="can only coarsen"):
        rebin(agent, 96)
    mc = load_trace(_jsonl(tmp_path / "m.jsonl", [
        {"timestamp": 500, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}]),
        namespace=2)
    both = merge_traces([agent, mc])
    assert both.block_tokens == 512 and len(both.requests) == 8
    assert [r.t for r in both.requests] == sorted(r.t for r in both.requests)
    tags = {h >> FILE_SHIFT for r in both.requests for h in r.hash_ids}
    assert tags == {1, 2}


def test_class_rules() -> None:
    rule = ClassRule.parse("conversation*=chat, type:api=batch,session:s9*=agent,default")
    assert rule.classify("conversation_trace.jsonl", "", "x", "chat") == "chat"
    assert rule.classify("other", "api", "x", "chat") == "batch"
    assert rule.classify("other", "", "s99", "chat") == "agent"
    assert rule.classify("other", "", "x", "chat") == "default"
    assert ClassRule.parse(None).classify("f", "", "s", "agent") == "agent"
    with pytest.raises(ValueError, match="class 'Bad Class'"):
        ClassRule.parse("x=Bad Class")
    with pytest.raises(ValueError, match="unknown field 'user'"):
        ClassRule.parse("user:x=chat")


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="does not exist"):
        load_trace(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1, "hash_ids": [1], "input_length": 5}\nnot json\n')
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:2: not JSON"):
        load_trace(bad)
    (tmp_path / "nohash.jsonl").write_text('{"timestamp": 1}\n')
    with pytest.raises(TraceFormatError, match="needs timestamp and hash_ids"):
        load_trace(tmp_path / "nohash.jsonl")
    (tmp_path / "junk.tar.xz").write_bytes(b"not a tar")
    with pytest.raises(TraceFormatError, match="not a readable tar"):
        load_trace(tmp_path / "junk.tar.xz")
    with pytest.raises(ValueError, match="time_scale"):
        load_trace(bad, time_scale=0)


@pytest.mark.skipif(not SHARED.exists(), reason="shared traces not present")
def test_real_traces_load() -> None:
    conv = load_trace(SHARED / "mooncake-fast25/conversation_trace.jsonl", max_requests=500)
    assert len(conv.requests) == 500 and conv.requests[-1].t <= 3537
    agent = load_trace(SHARED / "weka-claude-code/traces.tar.xz", max_sessions=2, seed=3)
    assert agent.block_tokens == 64 and {r.traffic_class for r in agent.requests} == {"agent"}
    assert all(len(r.hash_ids) == r.input_length // 64 for r in agent.requests)


def test_csv_table_form(tmp_path: Path) -> None:
    p = tmp_path / "ops.csv"
    p.write_text("# block_tokens=16\n"
                 "time,session,hashes,input_length,class\n"
                 "1.5,u1,aa bb cc,40,agent\n"
                 "0.5,u2,aa dd,,\n"
                 "2.0,u1,aa bb cc ee,64,agent\n")
    tr = load_trace(p, namespace=3)
    assert tr.block_tokens == 16 and [r.t for r in tr.requests] == [0.5, 1.5, 2.0]
    first, second, third = tr.requests
    assert first.session == "u2" and first.input_length == 32 and first.traffic_class == "chat"
    assert second.traffic_class == "agent" and second.input_length == 40
    # the same hash text is the same id within the file, namespaced by the file tag
    assert first.hash_ids[0] == second.hash_ids[0] == third.hash_ids[0]
    assert third.hash_ids[:3] == second.hash_ids and all(h >> FILE_SHIFT == 3
                                                         for h in third.hash_ids)
    # --class-of still overrides, and a bad row names its line
    assert load_trace(p, class_of="chat").requests[1].traffic_class == "chat"
    bad = tmp_path / "bad.csv"
    bad.write_text("time,session,hashes\nsoon,u1,aa\n")
    with pytest.raises(TraceFormatError, match=r"bad.csv:2: bad row"):
        load_trace(bad)
    missing = tmp_path / "missing.csv"
    missing.write_text("time,hashes\n1,aa\n")
    with pytest.raises(TraceFormatError, match="columns are time, session, hashes"):
        load_trace(missing)


def test_parquet_needs_pyarrow_or_loads(tmp_path: Path) -> None:
    p = tmp_path / "ops.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        p.write_bytes(b"PAR1")
        with pytest.raises(TraceFormatError, match="needs pyarrow"):
            load_trace(p)
        return
    table = pa.table({"time": [0.0, 1.0], "session": ["a", "a"],
                      "hashes": [["x"], ["x", "y"]]}).replace_schema_metadata(
        {"block_tokens": "32"})
    pq.write_table(table, p)
    tr = load_trace(p)
    assert tr.block_tokens == 32 and tr.requests[1].hash_ids[0] == tr.requests[0].hash_ids[0]


def test_compact_directory_loads_as_a_trace(tmp_path: Path) -> None:
    from common.trace_arrays import CompactTrace

    src = _jsonl(tmp_path / "m.jsonl", [
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 1000, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 3]}])
    tr = load_trace(src)
    d = CompactTrace.from_trace(tr).save(tmp_path / "c")
    back = load_trace(d, time_scale=2.0)
    assert [r.t for r in back.requests] == [0.0, 2.0]
    assert [len(r.hash_ids) for r in back.requests] == [2, 3]
    assert back.requests[1].hash_ids[:2] == back.requests[0].hash_ids
    assert back.block_tokens == 512
