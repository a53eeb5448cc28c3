"""``kvserve trace export``: the exported file keeps the source's prefix-sharing
structure (at the coarsened block size), its prompts fit the context, and text
prompts tokenize back to whole 64-token blocks."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from common.trace_types import Trace, TraceRequest
from common.traces import load_trace, rebin
from kvserve.trace_export import (
    BlockText,
    ExportError,
    ExportOptions,
    Interleave,
    interleave,
    min_tokens_between_turns,
    read_export,
    reuse_profile,
    reuse_totals,
    scale_trace,
    text_reuse,
)
from tests.shared_data import shared_dir

SHARED = shared_dir()
CLAUDE = SHARED / "traces" / "weka-claude-code" / "traces.tar.xz"
MOONCAKE = SHARED / "traces" / "mooncake-fast25" / "conversation_trace.jsonl"


def _renamed(ids_per_request: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Ids renamed densely in order of first use: equal lists = equal sharing structure."""
    names: dict[int, int] = {}
    return [tuple(names.setdefault(h, len(names)) for h in ids) for ids in ids_per_request]


@pytest.mark.parametrize("source,kwargs", [(CLAUDE, {"max_sessions": 3}),
                                           (MOONCAKE, {"max_requests": 300})])
def test_round_trip_keeps_the_reuse_structure(tmp_path: Path, source: Path,
                                               kwargs: dict[str, int]) -> None:
    if not source.exists():
        pytest.skip(f"{source} not in this checkout's shared data")
    out = tmp_path / "new-dir" / "t.jsonl"
    cmd = [sys.executable, "-m", "kvserve.cli", "trace", "export", str(source), "--out", str(out),
           "--max-input", "6000", "--json"]
    for k, v in kwargs.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    summary = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    # Users' prompts (as ids) and what the CLI creates on the way are private, umask or not.
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert stat.S_IMODE(out.parent.stat().st_mode) == 0o700
    written = read_export(out)
    src = load_trace(source, **kwargs)
    scaled, _ = scale_trace(src, ExportOptions(max_input_tokens=6000))
    assert len(written.requests) == len(src.requests) == summary["requests"]
    assert max(r.input_length for r in written.requests) <= 6000
    # Exactly the ids the scaling made, read back from the file.
    assert [r.hash_ids for r in written.requests] == [r.hash_ids for r in scaled.requests]
    # And that structure is the source's, coarsened to k source blocks per block
    # (or each source block split into r), cut to the context: the sharing between
    # any two requests is unchanged up to renaming.
    k = summary["source_blocks_per_block"]
    if k >= 1:
        coarse = rebin(src, src.block_tokens * int(k)) if k > 1 else src
        expect = [r.hash_ids[:6000 // 64] for r in coarse.requests]
    else:
        r_split = round(1 / k)
        expect = [tuple(h * r_split + j for h in r.hash_ids for j in range(r_split))[:6000 // 64]
                  for r in src.requests]
    assert _renamed([r.hash_ids for r in written.requests]) == _renamed(expect)
    # The reuse a 64-token block cache can find, as reported.
    assert sum(reuse_profile(written)) * 64 == summary["reusable_tokens"]
    if source == CLAUDE:
        assert summary["reusable_tokens"] > 0.5 * summary["prompt_tokens"]


def test_text_blocks_tokenize_to_whole_blocks(smollm2_dir: str) -> None:
    text = BlockText(smollm2_dir, 64, seed=3)
    first = text.block(7)
    assert text.count(first) == 64
    assert text.block(7) == first                      # the same block in every request
    two = text.block(7) + text.block(8)
    assert text.count(two) == 128                      # no token merges across blocks
    ids_two = text._tok.encode(two, add_special_tokens=False).ids
    assert ids_two[:64] == text._tok.encode(first, add_special_tokens=False).ids
    assert text.count(text.block(9, 10)) == 10         # a partial last block


def test_aiperf_rows_carry_text_and_the_session(tmp_path: Path, smollm2_dir: str) -> None:
    if not CLAUDE.exists():
        pytest.skip("Claude Code traces not in this checkout's shared data")
    out = tmp_path / "a.jsonl"
    subprocess.run([sys.executable, "-m", "kvserve.cli", "trace", "export", str(CLAUDE),
                    "--out", str(out), "--format", "aiperf", "--max-sessions", "2",
                    "--max-input", "2000", "--model", smollm2_dir], check=True,
                   capture_output=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(set(r) == {"timestamp", "text_input", "output_length", "extra"} for r in rows)
    assert len({r["extra"]["session_id"] for r in rows}) == 2
    # A later turn of a session starts with the text of an earlier one's full blocks.
    text = BlockText(smollm2_dir, 64)
    by = {}
    for r in rows:
        by.setdefault(r["extra"]["session_id"], []).append(r["text_input"])
    turns = max(by.values(), key=len)
    assert text.count(turns[0]) <= 2000
    shared = 0
    for a, b in zip(turns[0].split(" "), turns[-1].split(" "), strict=False):
        if a != b:
            break
        shared += 1
    assert shared >= 64


def test_text_reuse_matches_the_hash_ids_it_was_written_from(smollm2_dir: str) -> None:
    if not CLAUDE.exists():
        pytest.skip("Claude Code traces not in this checkout's shared data")
    src = load_trace(CLAUDE, max_sessions=2, max_requests=12)
    scaled, _ = scale_trace(src, ExportOptions(max_input_tokens=1500))
    text = BlockText(smollm2_dir, 64)
    prompt, reusable = text_reuse([text.prompt(r) for r in scaled.requests], smollm2_dir)
    assert (prompt, reusable) == reuse_totals(scaled)
    assert reusable > 0



def test_session_rows_send_turns_in_order_as_completion_bodies(tmp_path: Path) -> None:
    """``aiperf-sessions``: a top-level session id (AIPerf sends a session's turns
    one after another), the /v1/completions body verbatim, and for a byte-tokenizer
    shape each block exactly 64 tokens (bytes) wherever it stands."""
    if not CLAUDE.exists():
        pytest.skip("Claude Code traces not in this checkout's shared data")
    out = tmp_path / "s.jsonl"
    subprocess.run([sys.executable, "-m", "kvserve.cli", "trace", "export", str(CLAUDE),
                    "--out", str(out), "--format", "aiperf-sessions", "--max-sessions", "2",
                    "--max-requests", "12", "--max-input", "4096", "--output-tokens", "9",
                    "--model", "llama-8b-shape"], check=True, capture_output=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    src = load_trace(CLAUDE, max_sessions=2, max_requests=12)
    scaled, _ = scale_trace(src, ExportOptions(max_input_tokens=4096, output_tokens=9))
    assert [r["session_id"] for r in rows] == [r.session for r in scaled.requests]
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    for row, req in zip(rows, scaled.requests, strict=True):
        body = row["payload"]
        assert set(row) == {"timestamp", "session_id", "payload"}
        assert body["model"] == "llama-8b-shape" and body["session_id"] == row["session_id"]
        assert body["max_tokens"] == 9 and body["ignore_eos"] and body["stream"]
        assert body["stream_options"] == {"include_usage": True}
        assert len(body["prompt"].encode()) == req.input_length    # one token per byte
    # Shared prefixes are shared text: two requests with j common ids share j * 64 bytes.
    a, b = scaled.requests[0], next(r for r in scaled.requests[1:] if r.session == scaled.
                                     requests[0].session)
    common = 0
    while common < min(len(a.hash_ids), len(b.hash_ids)) and \
            a.hash_ids[common] == b.hash_ids[common]:
        common += 1
    pa, pb = rows[0]["payload"]["prompt"], rows[scaled.requests.index(b)]["payload"]["prompt"]
    full = min(common, a.input_length // 64)
    assert pa[:full * 64] == pb[:full * 64]
    if full < min(len(pa), len(pb)) // 64:
        assert pa[full * 64:(full + 1) * 64] != pb[full * 64:(full + 1) * 64]


def test_byte_text_blocks_are_64_bytes() -> None:
    text = BlockText("llama-8b-shape", 64, seed=1)
    assert text.count(text.block(3)) == 64 == len(text.block(3).encode())
    assert text.block(3) == BlockText("llama-8b-shape", 64, seed=1).block(3)
    assert text.block(3) != text.block(4) and text.count(text.block(5, 10)) == 10


def _session(name: str, sizes: list[int], t0: float = 0.0) -> list[TraceRequest]:
    """A session whose turn i has ``sizes[i]`` 64-token blocks, each turn extending
    the previous one's ids (an agent's context grows)."""
    base = sum(map(ord, name)) << 20
    return [TraceRequest(t=t0 + 20.0 * i, session=name, hash_ids=tuple(range(base, base + n)),
                         input_length=64 * n, output_length=100, traffic_class="agent")
            for i, n in enumerate(sizes)]


def test_interleave_sends_paused_sessions_round_robin() -> None:
    """The first N fitting main-agent sessions in name order, their turns
    round-robin one request every gap, each session pausing N x gap; sessions too
    short, too long, too small at the start, or sub-agents are passed over."""
    reqs = [*_session("s4", [200, 210, 220]), *_session("s1", [300, 320, 330], 5.0),
            *_session("s2", [100, 120, 130]),                  # first turn too small
            *_session("s3", [400, 900, 950]),                  # second turn over --max-input
            *_session("s0", [500, 520]),                       # too few turns
            *_session("s1/agent", [300, 310, 320]),            # a sub-agent
            *_session("s5", [250, 260, 270, 280])]
    trace = Trace("t", 64, tuple(sorted(reqs, key=lambda r: r.t)), "test")
    opts = ExportOptions(block_tokens=64, context_scale=1.0, max_input_tokens=64 * 800)
    out = interleave(trace, Interleave(3, turns=3, gap_s=2.5, min_first_input=64 * 150), opts)
    assert [(r.session, r.t) for r in out.requests] == [
        ("s1", 0.0), ("s4", 2.5), ("s5", 5.0), ("s1", 7.5), ("s4", 10.0), ("s5", 12.5),
        ("s1", 15.0), ("s4", 17.5), ("s5", 20.0)]
    # Each turn is the session's own, in order (ids untouched).
    assert [len(r.hash_ids) for r in out.requests if r.session == "s5"] == [250, 260, 270]
    _, summary = scale_trace(out, opts)
    # Fewest between two turns: s4's and s5's first turns before s1 returns (200 + 250).
    assert summary.min_tokens_between_turns == 64 * (200 + 250)
    assert summary.sessions == 3 and summary.truncated == 0
    with pytest.raises(ExportError, match="only 3 sessions"):
        interleave(trace, Interleave(4, turns=3, gap_s=2.5, min_first_input=64 * 150), opts)
    with pytest.raises(ExportError, match="--context-scale"):
        interleave(trace, Interleave(3), ExportOptions())


def test_min_tokens_between_turns() -> None:
    reqs = [TraceRequest(float(i), s, (i,), n, 1, "agent")
            for i, (s, n) in enumerate([("a", 10), ("b", 7), ("c", 5), ("a", 9), ("b", 1)])]
    assert min_tokens_between_turns(reqs) == 7 + 5            # a returns (b: 5 + 9)
    assert min_tokens_between_turns(reqs[:3]) == -1           # nobody returns


def test_interleaved_export_of_the_claude_code_sessions(tmp_path: Path) -> None:
    """``--interleave`` on the real sessions: the rows are the sessions' turns
    round-robin at the gap, and the summary's flush is what the rows say."""
    if not CLAUDE.exists():
        pytest.skip("Claude Code traces not in this checkout's shared data")
    out = tmp_path / "p.jsonl"
    cmd = [sys.executable, "-m", "kvserve.cli", "trace", "export", str(CLAUDE), "--out",
           str(out), "--max-sessions", "60", "--interleave", "4", "--turns", "3", "--gap", "1.5",
           "--min-first-input", "500", "--block-tokens", "1", "--context-scale", "0.015625",
           "--max-input", "4000", "--output-tokens", "8", "--max-output", "8", "--json"]
    summary = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == summary["requests"] == 12 and summary["truncated"] == 0
    assert [r["timestamp"] for r in rows] == [1500.0 * i for i in range(12)]   # ms
    assert all(r["output_length"] == 8 and 500 <= r["input_length"] <= 4000 for r in rows)
    # Ids are namespaced per session, so a first id names its session: each round
    # holds the 4 sessions once, in the same order, and most of every prompt is reuse.
    firsts = [r["hash_ids"][0] for r in rows]
    assert len(set(firsts[:4])) == 4 and firsts == firsts[:4] * 3
    assert summary["reusable_tokens"] > 0.5 * summary["prompt_tokens"]
    between = min(sum(r["input_length"] for r in rows[i - 3:i]) for i in range(4, 12))
    assert summary["min_tokens_between_turns"] == between
