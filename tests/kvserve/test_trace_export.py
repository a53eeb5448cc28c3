"""``kvserve trace export``: the exported file keeps the source's prefix-sharing
structure (at the coarsened block size), its prompts fit the context, and text
prompts tokenize back to whole 64-token blocks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.traces import load_trace, rebin
from kvserve.trace_export import (
    BlockText,
    ExportOptions,
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
    out = tmp_path / "t.jsonl"
    cmd = [sys.executable, "-m", "kvserve.cli", "trace", "export", str(source), "--out", str(out),
           "--max-input", "6000", "--json"]
    for k, v in kwargs.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    summary = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
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
