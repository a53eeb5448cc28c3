"""engine/triton_draw.py's kernel, checked on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, in a child process: the interpreter is chosen when the
kernel module is first imported): it draws exactly the tokens of engine/draw.py's
host path, row by row, however the vocabulary is split into ranges."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the device runs the real kernel"),
    pytest.mark.skipif(__import__("importlib.util").util.find_spec("triton") is None,
                       reason="needs Triton (its interpreter)"),
]

ROOT = Path(__file__).resolve().parents[2]


def test_kernel_draws_the_host_paths_tokens() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("draw ok"), proc.stdout[-2000:]


def _check() -> None:
    from engine import draw as d
    from engine import triton_draw as td

    g = torch.Generator().manual_seed(4)
    for n, vocab in ((1, 700), (5, 2500), (9, 4100)):
        x = torch.randn(n, vocab, generator=g) * 3
        x[0, 5] = float("nan")
        x[-1, 10:20] = float("-inf")
        # a tie for greedy, in one range and across ranges (the pick keeps the first)
        x[n // 2, 100] = x[n // 2, 300] = x[n // 2, vocab - 50] = 40.0
        temps = [(0.0, 1.0, 0.6, 1.7)[i % 4] for i in range(n)]
        tops = [(1.0, 1.0, 0.8, 0.3)[i % 4] if i % 5 else 1.0 for i in range(n)]
        keys = [(i * 0x9E3779B97F4A7C15 + vocab) % (2**63 - 1) for i in range(n)]
        want = d._draw_host(x, temps, tops, keys)
        t = torch.tensor(temps)
        cut = torch.full((n,), float("-inf"))
        for i in range(n):
            if temps[i] > 0 and tops[i] < 1:
                cut[i] = d.nucleus_cut(x[i:i + 1], t[i:i + 1],
                                       torch.tensor([tops[i]], dtype=torch.float64))[0]
        words = torch.tensor([d.key_halves(k) for k in keys], dtype=torch.int64)
        for splits in (1, 2, 3):
            td.splits_for = lambda rows, voc, sms, s=splits: s  # type: ignore[assignment]
            got = td.draw(x, t, cut, words).tolist()
            assert got == want, (n, vocab, splits, got, want)
        # the CUDA path's packing of the per-row inputs, on CPU tensors here: the
        # kernel reads the packed fp64 columns where they lie, and the path before
        # issue 21 (widened copy, cast inputs, torch's pick) draws the same tokens
        for fused in (True, False):
            d.FUSED = fused
            assert d._draw_device(x, temps, tops, keys) == want, (n, fused)
        d.FUSED = True
        # half logits are widened inside the kernel: the tokens of a widened copy
        half = x.half()
        assert d._draw_device(half, temps, tops, keys) == \
            d._draw_host(half.float(), temps, tops, keys), n
    print("draw ok")


if __name__ == "__main__":
    _check()
