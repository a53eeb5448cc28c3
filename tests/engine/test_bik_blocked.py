"""The blocked GEMM and the row-blocked attention of native/bik.c: a row's
bytes do not depend on the rows beside it (M = 1, 7, 512, 1000: one or many
row blocks, every panel grouping), on the thread count (work is claimed
dynamically, so who computes what differs from run to run) or on the SIMD
path. The reference is each row alone on the scalar path."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from engine import bik

pytestmark = pytest.mark.skipif(not bik.available(), reason="native._bik not built")

ROWS = (1, 7, 512, 1000)
THREADS = (1, 2, 3)


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    threads, path = bik.threads(), bik.current_path()
    yield
    bik.set_threads(threads)
    bik.use_path(path)


def each_setting() -> Iterator[tuple[str, int]]:
    for path in bik.paths():
        for n in THREADS:
            bik.use_path(path)
            bik.set_threads(n)
            yield path, n


def alone(fn: Callable[[int], torch.Tensor], rows: int) -> torch.Tensor:
    """fn(i) computes row i by itself, on the scalar path and one thread."""
    bik.use_path("scalar")
    bik.set_threads(1)
    return torch.cat([fn(i) for i in range(rows)])


@pytest.mark.parametrize(("k", "n", "bias"), [(160, 200, False), (96, 592, True)])
def test_gemm_rows_match_alone_for_every_row_count_thread_count_and_path(
        k: int, n: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(max(ROWS), k, generator=g)
    w = bik.pack(torch.randn(k, n, generator=g))
    b = torch.randn(n, generator=g) if bias else None
    ref = alone(lambda i: bik.linear(x[i:i + 1], w, b), max(ROWS))
    for path, threads in each_setting():
        for m in ROWS:
            got = bik.linear(x[:m], w, b)
            assert torch.equal(got, ref[:m]), (path, threads, m)


def test_gemm_long_k_spans_several_k_blocks_and_strided_rows() -> None:
    """K past one K block (the running sums parked and picked up again) and
    rows with a stride wider than K give the same bytes as one row alone."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(9, 2100 + 37, generator=g)
    x = base[:, :2100]                      # row stride 2137
    w_t = torch.randn(2100, 40, generator=g)
    w = bik.pack(w_t)
    ref = alone(lambda i: bik.linear(x[i:i + 1].contiguous(), w), 9)
    for path, threads in each_setting():
        assert torch.equal(bik.linear(x, w), ref), (path, threads)
    # The parked sums are picked up, not restarted: the result is the product.
    assert torch.allclose(ref.double(), x.double() @ w_t.double(), rtol=1e-4, atol=1e-3)


def _kv(heads: int, cap: int, d: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(2, heads, cap, d, generator=g)


@pytest.mark.parametrize(("heads", "kv_heads", "d", "window"),
                         [(9, 3, 64, 0), (4, 2, 32, 0), (3, 1, 48, 0), (6, 3, 64, 40)])
def test_attention_rows_match_alone_for_every_split_thread_count_and_path(
        heads: int, kv_heads: int, d: int, window: int) -> None:
    """Query rows attended in blocks (sharing each K block and each V pass)
    equal each row attended alone: causal rows of different key counts in one
    block, two sequences in one call, a sliding window whose first key moves."""
    g = torch.Generator().manual_seed(heads * d + window)
    cap = 96
    kv_a, kv_b = _kv(kv_heads, cap, d, g), _kv(kv_heads, cap, d, g)
    rows_a, start_a, rows_b, start_b = 37, 20, 11, 70
    q = torch.randn(rows_a + rows_b, heads, d, generator=g)
    segs = [bik.AttnSegment(0, rows_a, start_a, kv_a),
            bik.AttnSegment(rows_a, rows_b, start_b, kv_b)]

    def one(i: int) -> torch.Tensor:
        out = torch.empty(1, heads * d)
        seg = segs[0] if i < rows_a else segs[1]
        r = i - seg.row0
        bik.attend(q[i:i + 1], [bik.AttnSegment(0, 1, seg.q_start + r, seg.kv)],
                   kv_heads, window, out)
        return out

    ref = alone(one, rows_a + rows_b)
    for path, threads in each_setting():
        out = torch.empty(rows_a + rows_b, heads * d)
        bik.attend(q, segs, kv_heads, window, out)
        assert torch.equal(out, ref), (path, threads)
        # a prefix of the first sequence's rows: blocks cut at another place
        part = torch.empty(13, heads * d)
        bik.attend(q[:13], [bik.AttnSegment(0, 13, start_a, kv_a)], kv_heads, window, part)
        assert torch.equal(part, ref[:13]), (path, threads)


def test_threads_round_trip() -> None:
    bik.set_threads(3)
    assert bik.threads() == 3
    bik.set_threads(0)
    assert bik.threads() == 1
