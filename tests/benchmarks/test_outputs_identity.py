"""benchmarks/outputs_identity.py reads AIPerf's raw export and outputs file, and
flags an answer that differs from a cache-less engine's (and only that one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.outputs_identity import main
from engine.config import EngineConfig
from engine.runner import Engine
from engine.sampling import SamplingParams

MODEL = "tiny-dense"


def _write_run(d: Path, rows: list[tuple[str, str, float]]) -> None:
    """AIPerf 0.13's two files: (request id, prompt, temperature) with the answer
    a cache-less engine gives, the second one's answer altered."""
    eng = Engine(EngineConfig(model=MODEL, num_blocks=64))
    raw, outs = [], []
    for i, (rid, prompt, temp) in enumerate(rows):
        text = eng.generate(eng.tokenizer.encode(prompt), SamplingParams(max_tokens=6)).text
        if i == 1:
            text += "x"
        raw.append({"metadata": {"x_request_id": rid}, "status": 200,
                    "payload": {"model": MODEL, "prompt": prompt, "max_tokens": 6,
                                "temperature": temp, "stream": True}})
        outs.append({"x_request_id": rid, "response_text": text})
    (d / "profile_export_raw.jsonl").write_text("".join(json.dumps(r) + "\n" for r in raw))
    (d / "outputs.json").write_text(json.dumps({"schema_version": "1.0", "data": outs}))


def test_an_altered_answer_is_the_one_flagged(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    _write_run(tmp_path, [("a", "the first prompt, a little longer than the rest", 0.0),
                          ("b", "a second prompt", 0),
                          ("c", "and a third one", 0.0),
                          ("d", "sampled, so not compared", 0.7)])
    rc = main(["--artifacts", str(tmp_path), "--model", MODEL, "--num-blocks", "64", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert (out["requests"], out["identical"], out["not_greedy"]) == (3, 2, 1)
    assert [m["request_id"] for m in out["mismatches"]] == ["b"]
    assert out["mismatches"][0]["served"] == out["mismatches"][0]["cache_less"] + "x"


def test_a_raw_export_without_payloads_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "profile_export_raw.jsonl").write_text(
        json.dumps({"metadata": {"x_request_id": "a"}}) + "\n")
    (tmp_path / "outputs.json").write_text(json.dumps(
        {"data": [{"x_request_id": "a", "response_text": "hi"}]}))
    with pytest.raises(ValueError, match="export-level raw"):
        main(["--artifacts", str(tmp_path), "--model", MODEL])
