"""The batch-invariant GPU kernels' logic, checked on the CPU: Triton's
interpreter (``TRITON_INTERPRET=1``) runs the same kernels on numpy, so their
indexing, masks, key splits, the decode shares and their fold, and the GEMM
plans are exercised without a GPU, on tiny shapes. Bit-identity here proves the
algorithm (what each row computes does not depend on its neighbours); that the
H200's matrix units agree across tile shapes is tests/engine/test_gpu_invariant.py's
job, on the device (here ``tl.dot`` is modelled as one fixed-order chain per
output, see ``_fixed_order_dot``). fp16 and fp32 only: the interpreter has no
bf16 arithmetic.

The checks run in child processes, because the interpreter is chosen when a
kernel module is first imported: two children side by side, each running its
checks in turn, grouped so the two take about as long (attention with the two
decode checks ~31 s, the two GEMM checks ~33 s on this 2-core box), since each
runs on one core (the interpreter is single-threaded Python) and a child's
start (torch, Triton, the kernel modules) costs ~6 s of CPU. Each check
reports on its own, so each test still passes or fails by its check alone."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="the device runs the real kernels"),
    pytest.mark.skipif(__import__("importlib.util").util.find_spec("triton") is None,
                       reason="needs Triton (its interpreter)"),
]

ROOT = Path(__file__).resolve().parents[2]


GROUPS = [["attention", "decode_graph_path", "paged_decode"], ["gemm", "gemm_splits"]]
CHECKS = [c for group in GROUPS for c in group]
MARK = "\n=== check "                 # heads each check's part of a child's output


@pytest.fixture(scope="module")
def reports() -> dict[str, str]:
    """What each check printed, from the children that ran them."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    children = [subprocess.Popen([sys.executable, __file__, *group], env=env, cwd=ROOT,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for group in GROUPS]
    out: dict[str, str] = {}
    try:
        for proc, group in zip(children, GROUPS, strict=True):
            stdout, stderr = proc.communicate(timeout=600)
            for part in stdout.split(MARK)[1:]:
                name, _, text = part.partition("\n")
                out[name] = text
            assert proc.returncode in (0, 1) and set(group) <= set(out), \
                stdout[-3000:] + stderr[-3000:]
    finally:
        for proc in children:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


@pytest.mark.parametrize("check", CHECKS)
def test_kernel_logic_under_the_interpreter(check: str, reports: dict[str, str]) -> None:
    assert reports[check].strip().endswith(f"{check} ok"), reports[check][-3000:]


# ----------------------------------------------------------- the checks
def check_gemm() -> None:
    from engine.triton_gemm import GemmPlan, linear

    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float16, torch.float32):
        for k, n in ((96, 40), (128, 200)):          # K off and on the K tile
            w_t = torch.randn(n, k, generator=g).to(dtype).t()     # as weights.py
            bias = torch.randn(n, generator=g).to(dtype)
            x = torch.randn(600, k, generator=g).to(dtype)
            full = linear(x, w_t, bias)
            ref = x.double() @ w_t.double() + bias.double()
            err = ((full.double() - ref).norm() / ref.norm()).item()
            assert err < 2e-3, (dtype, k, n, err)
            for m in (1, 2, 17, 64, 65, 130, 513):   # across the plan classes
                assert torch.equal(linear(x[:m], w_t, bias), full[:m]), (dtype, m)
                assert torch.equal(linear(x[600 - m:], w_t, bias), full[600 - m:]), (dtype, m)
            plans = [GemmPlan(64, 32, 4, 2), GemmPlan(128, 64, 8, 2, group_m=2)]
            if dtype != torch.float32:                  # the TMA candidate is 16-bit only
                plans.append(GemmPlan(128, 256, 8, 3, persistent=True))
            for plan in plans:
                assert torch.equal(linear(x, w_t, bias, plan=plan), full), plan
            if dtype != torch.float32:                  # weights.py's [K, N] rows under TMA
                assert torch.equal(linear(x, w_t.contiguous(), bias, plan=plans[-1]), full)
            if dtype == torch.float16 and k == 128:
                _check_decode_table(x, w_t, bias, full)
    print("gemm ok")


def _check_decode_table(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor,
                        full: torch.Tensor) -> None:
    """``DECODE_PLANS`` (benchmarks/gemm_sweep.py's table): a weight's decode rows
    take its shape's plan, a weight-major one with its input side set by M, other
    shapes and split weights the rule's, and the rows keep their bits."""
    from engine import triton_gemm as tg

    k, n = w_t.shape
    swap, wide = tg.GemmPlan(64, 64, 4, 2, swap=True, bk=128), tg.GemmPlan(64, 32, 4, 2, bk=128)
    shipped, tg.DECODE_PLANS = tg.DECODE_PLANS, {(k, n, 64): swap, (k, n, 16): wide}
    try:
        assert tg.plan_16bit(40, n, 1, k=k) == swap
        assert tg.plan_16bit(33, n, 1, k=k).bm == 64 and tg.plan_16bit(9, n, 1, k=k) == wide
        assert tg.plan_16bit(40, n, 1, k=k + 64) == tg.plan_16bit(40, n, 1)   # another weight
        assert tg.plan_16bit(40, n, 2, k=k) == tg.plan_16bit(40, n, 2)        # split sums
        assert tg.plan_16bit(20, n, 1, k=k) == tg.plan_16bit(20, n, 1)        # no 32 entry
        for m in (1, 16, 33, 64):
            assert torch.equal(tg.linear(x[:m], w_t, bias), full[:m]), m
            assert torch.equal(tg.linear(x[-m:], w_t, bias), full[-m:]), m
    finally:
        tg.DECODE_PLANS = shipped


def check_gemm_splits() -> None:
    """K in two or three sums (the option ``k_splits`` gives narrow weights
    when ``SPLITS`` > 1): a program a split folded by the last to finish
    (M <= 64, weight-major and 64-row tiles) or the splits in turn in one
    program (more rows) give every row the same bits, the counters end at
    zero, and the sums are really split (fp32 shows it)."""
    from engine import triton_gemm as tg
    from engine.triton_gemm import GemmPlan, k_splits, linear

    # the rule: narrow 16-bit weights with K a multiple of the unit take SPLITS
    # (shipped 1), every other weight 1
    shipped = tg.SPLITS
    for sp in (shipped, 2):
        tg.SPLITS = sp
        assert k_splits(torch.bfloat16, 6144, 4096) == k_splits(torch.float16, 4096, 14336) == sp
        assert k_splits(torch.bfloat16, 28672, 4096) == k_splits(torch.float32, 4096, 4096) == 1
        assert k_splits(torch.bfloat16, 4096, 576) == 1
    tg.SPLITS = shipped
    g = torch.Generator().manual_seed(2)
    # one dtype per split count: the interpreter is slow, and the suite's time is
    # shared (fp16 with two sums, fp32, where other sums show, with three)
    for dtype, sp in ((torch.float16, 2), (torch.float32, 3)):
        k, n = 128 * sp * 2, 136                  # K a multiple of the splits' 128-deep stages
        w_t = torch.randn(n, k, generator=g).to(dtype).t()
        bias = torch.randn(n, generator=g).to(dtype)
        x = torch.randn(200, k, generator=g).to(dtype)
        full = linear(x, w_t, bias, splits=sp)
        ref = x.double() @ w_t.double() + bias.double()
        assert ((full.double() - ref).norm() / ref.norm()).item() < 2e-3
        if dtype == torch.float32:                # other sums, other roundings
            assert not torch.equal(full, linear(x, w_t, bias, splits=1)), sp
        for m in (1, 17, 64, 65, 130):
            assert torch.equal(linear(x[:m], w_t, bias, splits=sp), full[:m]), (dtype, sp, m)
            assert torch.equal(linear(x[200 - m:], w_t, bias, splits=sp), full[200 - m:])
        for plan in (GemmPlan(64, 32, 4, 2), GemmPlan(128, 64, 8, 2, group_m=2),
                     GemmPlan(64, 64, 4, 2, bk=128), GemmPlan(32, 64, 4, 2, swap=True)):
            for m in (5, 64, 200):
                if not (plan.swap and m > 64):
                    got = linear(x[:m], w_t, bias, plan=plan, splits=sp)
                    assert torch.equal(got, full[:m]), (dtype, sp, plan, m)
    for buf, _ in tg._COUNTERS.values():
        assert int(buf.abs().sum()) == 0              # every tile's counter reset
    print("gemm_splits ok")


def _pool_and_inputs(t: int, heads: int, kv_heads: int, dim: int, bt: int, nb: int,
                     seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                         torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pool = torch.full((1, 2, kv_heads, nb, bt, dim), float("nan"), dtype=torch.float16)
    table = torch.randperm(nb, generator=g)[: -(-t // bt)]
    k = torch.randn(t, kv_heads, dim, generator=g).half()
    v = torch.randn(t, kv_heads, dim, generator=g).half()
    pos = torch.arange(t)
    slots = table[pos // bt] * bt + pos % bt
    flat = pool.view(1, 2, kv_heads, nb * bt, dim)
    flat[0, 0, :, slots] = k.transpose(0, 1)
    flat[0, 1, :, slots] = v.transpose(0, 1)
    q = torch.randn(t, heads, dim, generator=g).half()
    return pool, table, q, k, v


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    t, h, d = q.shape
    grp = h // k.shape[1]
    kk = k.double().repeat_interleave(grp, 1).transpose(0, 1)
    vv = v.double().repeat_interleave(grp, 1).transpose(0, 1)
    s = q.double().transpose(0, 1) @ kk.transpose(1, 2) / d ** 0.5
    i = torch.arange(t)
    see = i[None, :] <= i[:, None]
    if window:
        see &= i[None, :] > i[:, None] - window
    o = s.masked_fill(~see, float("-inf")).softmax(-1) @ vv
    return o.transpose(0, 1).reshape(t, h * d)


def check_attention() -> None:
    from engine.triton_attention import (
        AHEAD_DECODE,
        DECODE,
        KEY_TILE,
        AttnSegment,
        DecodeSchedule,
        InvariantAttention,
        decode_scratch,
    )

    heads, kv_heads, dim, bt, split = 8, 2, 16, 16, 128      # splits of 2 key tiles
    t = 300
    for window in (0, 50):
        pool, table, q, k, v = _pool_and_inputs(t, heads, kv_heads, dim, bt, 64, window)

        def chunked(sizes: list[int], pool: torch.Tensor = pool, table: torch.Tensor = table,
                    q: torch.Tensor = q, window: int = window) -> torch.Tensor:
            out = torch.full((t, heads * dim), float("nan"), dtype=torch.float16)
            s = 0
            for c in sizes:
                InvariantAttention(pool, [AttnSegment(0, c, s, table)], heads, split=split)(
                    0, q[s:s + c], window, out[s:s + c])
                s += c
            assert s == t
            return out

        whole = chunked([t])
        ref = _reference(q, k, v, window)
        err = ((whole.double() - ref).norm() / ref.norm()).item()
        assert err < 2e-3, (window, err)
        for sizes in ([7] * 42 + [6], [1, 63, 64, 172], [129, 171]):
            assert torch.equal(chunked(sizes), whole), (window, sizes)
        # batched prefill: several sequences (segments) of one call, any lengths,
        # in any order, each row as in its own call
        rng = random.Random(window)
        cuts = sorted(rng.sample(range(1, t), 3))
        parts = list(zip([0, *cuts], [*cuts, t], strict=True))
        rng.shuffle(parts)
        out = torch.full((t, heads * dim), float("nan"), dtype=torch.float16)
        rows = torch.cat([torch.arange(a, b) for a, b in parts])
        segs, r0 = [], 0
        for a, b in parts:
            segs.append(AttnSegment(r0, b - a, a, table))
            r0 += b - a
        InvariantAttention(pool, segs, heads, split=split)(0, q[rows], window, out)
        assert torch.equal(out, whole[rows]), window
        # decode rows: one token each, its splits dealt over 1..5 programs (a
        # row of 3 splits at 2 programs: one program holds two of them)
        # rows; every decode schedule (loop form, stages, warps) gives the same
        # rows (the shipped one at every share count, the others at 1 and 3)
        at = [*rng.sample(range(t), 6), t - 1, 0]
        for sch, counts in ((DECODE, (1, 2, 3, 5)), (AHEAD_DECODE, (1, 3)),
                            (DecodeSchedule(1, 2), (1, 3))):
            for n_parts in counts:
                out = torch.full((len(at), heads * dim), float("nan"), dtype=torch.float16)
                acc, ml = (x.fill_(float("nan")) for x in decode_scratch(
                    len(at), t, heads, dim, torch.device("cpu"), split))
                InvariantAttention(pool, [AttnSegment(i, 1, p, table) for i, p in enumerate(at)],
                                   heads, parts=n_parts, split=split, schedule=sch)(
                    0, q[at], window, out, acc, ml)
                assert torch.equal(out, whole[at]), (window, str(sch), n_parts)
        if window:
            continue                         # a window of 50 keys spans at most 2 splits
        # fp32, whose outputs show a fold's rounding (fp16 hides most of it)
        pool32, q32 = pool.float(), q.float()
        whole64 = torch.full((t, heads * dim), float("nan"))
        InvariantAttention(pool32, [AttnSegment(0, t, 0, table)], heads, split=KEY_TILE)(
            0, q32, window, whole64)
        # rows with 5 splits, more than programs: 2 or 3 splits a program, and
        # the fold pass's rounds of 4 splits crossed; rows with 4 (252, 255: the
        # last tile part-full, then full) and 5 (256: one key in the fifth tile,
        # then on to the end). Each row is its own program under the interpreter
        # (~0.5 s here): eight rows, 1,024 outputs each time, show a fold's rounding.
        late = [t - 48, t - 45, t - 44, t - 43, t - 30, t - 17, t - 2, t - 1]
        for n_parts in (2, 3):
            out = torch.full((len(late), heads * dim), float("nan"))
            acc, ml = (x.fill_(float("nan")) for x in decode_scratch(
                len(late), t, heads, dim, torch.device("cpu"), KEY_TILE))
            InvariantAttention(pool32, [AttnSegment(i, 1, p, table)
                                        for i, p in enumerate(late)],
                               heads, parts=n_parts, split=KEY_TILE)(0, q32[late], window, out,
                                                                     acc, ml)
            diff = (out != whole64[late]).sum().item()
            assert diff == 0, (window, n_parts, "one-tile splits", diff)
    print("attention ok")


def check_decode_graph_path() -> None:
    """DecodeAttention over StepBuffers (what the CUDA graph replays): the fused
    K/V write lands where KVStorage.write puts it, and rows equal a prefill's."""
    from engine.kv_pool import KVLayout, KVStorage
    from engine.paged_decode import StepBuffers
    from engine.triton_attention import AttnSegment, InvariantAttention
    from engine.triton_invariant import DecodeAttention

    heads, kv_heads, dim, bt, t = 8, 2, 16, 16, 200
    lay = KVLayout(1, kv_heads, bt, dim, "float16")
    store, ref_store = KVStorage(lay, 32, torch.device("cpu")), KVStorage(lay, 32,
                                                                          torch.device("cpu"))
    pool, table, q, k, v = _pool_and_inputs(t, heads, kv_heads, dim, bt, 32, 5)
    store.data.copy_(pool)
    ref_store.data.copy_(pool)
    whole = torch.empty(t, heads * dim, dtype=torch.float16)
    InvariantAttention(pool, [AttnSegment(0, t, 0, table)], heads)(0, q, 0, whole)
    at = [0, 17, 63, 64, 150, 199]
    b, splits = 8, 3                                   # a bucket of 8: 2 padding rows
    scratch = int(torch.tensor(sorted(set(range(32)) - set(table.tolist())))[0])
    buf = StepBuffers(torch.zeros(b, dtype=torch.int64), torch.zeros(b, dtype=torch.int64),
                      torch.full((b,), scratch * bt, dtype=torch.int64),
                      torch.full((b, 16), scratch, dtype=torch.int32),
                      torch.ones(b, dtype=torch.int32),
                      torch.full((b, splits, heads, dim), float("nan")),
                      torch.full((b, splits, heads, 2), float("nan")), splits)
    for i, p in enumerate(at):
        buf.slots[i] = table[p // bt] * bt + p % bt
        buf.lens[i] = p + 1
        buf.tables[i, :len(table)] = table.to(torch.int32)
    kk = torch.zeros(b, kv_heads, dim, dtype=torch.float16)
    vv = torch.zeros(b, kv_heads, dim, dtype=torch.float16)
    kk[:len(at)], vv[:len(at)] = k[at], v[at]
    qq = torch.zeros(b, heads, dim, dtype=torch.float16)
    qq[:len(at)] = q[at]
    out = DecodeAttention(store, (0,), heads, buf)(0, qq, kk, vv)
    ref_store.write(0, buf.slots, kk, vv)
    assert torch.equal(store.data.nan_to_num(7.0), ref_store.data.nan_to_num(7.0))
    assert torch.equal(out[:len(at)], whole[at])
    print("decode_graph_path ok")


def _fixed_order_dot() -> None:
    """The interpreter's ``tl.dot`` is numpy's matmul, and OpenBLAS picks its
    kernel (and so its summation order) by shape: numpy is not batch-invariant
    itself. Model the matrix unit as the kernels assume it: one fp32 chain per
    output element over k = 0..K-1, added onto the accumulator in order."""
    import numpy as np
    from triton.runtime import interpreter as it

    def create_dot(self: object, a: it.TensorHandle, b: it.TensorHandle,
                   d: it.TensorHandle, input_precision: object,
                   max_num_imprecise_acc: object) -> it.TensorHandle:
        x, y = a.data.astype(np.float32), b.data.astype(np.float32)
        out = d.data.astype(np.float32).copy()
        for k in range(x.shape[-1]):
            out = out + x[..., :, k:k + 1] * y[..., k:k + 1, :]
        return it.TensorHandle(out.astype(d.data.dtype), d.dtype.scalar)

    it.InterpreterBuilder.create_dot = create_dot  # type: ignore[method-assign]


def check_paged_decode() -> None:
    """The ``triton`` family's decode kernel with key splits merged by one kernel."""
    from engine.paged_decode import paged_decode

    heads, kv_heads, dim, bt, nb = 8, 2, 16, 16, 40
    pool, table, q, k, v = _pool_and_inputs(nb * bt, heads, kv_heads, dim, bt, nb, 9)
    lens = [1, 15, 16, 130, 300]
    tables = torch.zeros(len(lens), 20, dtype=torch.int32)
    tables[:] = table[:20].to(torch.int32)
    for window in (0, 50):
        want = torch.cat([_reference(q[:n], k[:n], v[:n], window)[n - 1:n] for n in lens])
        for splits in (1, 4):
            acc = torch.full((len(lens), splits, heads, dim), float("nan"))
            ml = torch.full((len(lens), splits, heads, 2), float("nan"))
            out = paged_decode(q[[n - 1 for n in lens]], pool[0, 0], pool[0, 1], tables,
                               torch.tensor(lens, dtype=torch.int32), window, splits, acc, ml)
            err = ((out.double() - want).norm() / want.norm()).item()
            assert torch.isfinite(out).all() and err < 2e-3, (window, splits, err)
    print("paged_decode ok")


def _main(names: list[str]) -> int:
    """Runs each named check, a failure (with its traceback) not stopping the
    next one; exit status 1 if any failed."""
    import traceback

    torch.set_num_threads(1)
    _fixed_order_dot()
    checks = {"gemm": check_gemm, "gemm_splits": check_gemm_splits,
              "attention": check_attention, "paged_decode": check_paged_decode,
              "decode_graph_path": check_decode_graph_path}
    failed = 0
    for name in names:
        print(MARK + name, flush=True)
        try:
            checks[name]()
        except Exception:
            traceback.print_exc(file=sys.stdout)
            failed = 1
        sys.stdout.flush()
    return failed


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
