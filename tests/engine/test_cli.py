"""The engine's CLI commands (generate, model fetch, bench engine)."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.cli import main


def test_generate_prints_completion(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "tiny-dense", "--prompt", "hello", "--max-tokens", "5",
                 "--block-tokens", "16", "--num-blocks", "16", "--stats"]) == 0
    out = capsys.readouterr()
    assert "5 tokens" in out.err or "finish stop" in out.err


def test_generate_bad_input_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "tiny-dense", "--prompt", "", "--num-blocks", "4"]) == 2
    assert "empty prompt" in capsys.readouterr().err
    assert main(["generate", "--model", "/no/such/dir", "--prompt", "x"]) == 2
    assert "unknown model '/no/such/dir'" in capsys.readouterr().err


def test_model_fetch_prints_the_cached_dir(smollm2_dir: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model", "fetch", "smollm2"]) == 0
    assert capsys.readouterr().out.strip() == smollm2_dir
    assert main(["model", "fetch", "gpt5"]) == 2
    assert "known: ['smollm2']" in capsys.readouterr().err


def test_bench_engine_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "engine", "--model", "tiny-dense", "--json", "--decode-steps", "2",
                 "--num-blocks", "160"]) == 0
    out = capsys.readouterr()
    data = json.loads(out.out)
    for key in ("prefill_tok_s", "decode_tok_s_b1", "decode_tok_s_b8", "export_gbps",
                "import_gbps", "memcpy_d2h_gbps", "memcpy_h2d_gbps"):
        assert data[key] > 0, key
    assert "decode_tok_s_b8" in out.err                  # the table goes to stderr with --json


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_bench_engine_cuda_without_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "engine", "--device", "cuda"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
