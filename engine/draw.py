"""The next token of every row of a step, drawn in one pass over the batch's logits.

Sampling is Gumbel-max: row r's token is ``argmax_j(s_j + g_j)`` with
``s = logits / temperature`` (for top-p < 1, only the nucleus: tokens whose
logit reaches ``nucleus_cut``) and ``g_j = -log(-log(u_j))``, where ``u_j`` in
(0, 1) is a counter-based hash of (the row's key, j) and the key mixes the
sequence's seed and step (``SamplingParams.key``). That is an exact draw from
softmax(s). Temperature 0 is greedy: the first largest logit. NaN logits never win.

Why not ``torch.multinomial`` on a CPU generator per row, as before: each row
then cost a device sync, a copy of its logits to the host and an exponential
draw per vocabulary entry on one core, 8-17 ms a row for a 128k vocabulary.
In the whole stack on the H200 (issue 18, run 6) that was 398 ms of a decode
step at batch 46 whose forward took 6.3 ms. Here a CUDA batch is one Triton
launch (engine/triton_draw.py) and one copy of n token ids back.

Batch invariance (a sequence draws the same tokens alone or batched): the
noise depends on (key, j) only, each score is element-wise, and the max is
exact, so the first argmax is the same whatever rows share the call. The
nucleus sums its weights as 32.32 fixed-point integers, so its cumulative mass
is exact in any order. On the host every row is computed on its own (a numpy
or torch kernel may round a vector body and a scalar tail differently).
The hash is integer arithmetic, identical on every device; the logs may differ
by an ulp between devices, as their logits do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

# lowbias32 (a 32-bit integer finaliser with low bias), applied twice around the key.
MIX_A, MIX_B = 0x7FEB352D, 0x846CA68B
_A, _B = np.uint32(MIX_A), np.uint32(MIX_B)
# The nucleus' weights are fixed-point with this many fractional bits: the largest is
# 1.0, and a vocabulary of up to 2**21 entries keeps the total exact in a float64.
NUCLEUS_BITS = 32
# The device draw as shipped; False: as before issue 21 (benchmarks.decode_profile's
# ``host0`` mode times the two in one process). Same tokens either way.
FUSED = True


def key_halves(key: int) -> tuple[int, int]:
    """A row key (< 2**63) as the two uint32 words the hash takes."""
    return key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF


def _mix(x: np.ndarray) -> np.ndarray:
    # uint32 arrays wrap on overflow, as the kernel's uint32 arithmetic does
    x ^= x >> np.uint32(16)
    x *= _A
    x ^= x >> np.uint32(15)
    x *= _B
    x ^= x >> np.uint32(16)
    return x


def hash_u32(key: int, vocab: int) -> np.ndarray:
    """The row's hash of every vocabulary index: mix(mix(j ^ k0) + k1), uint32."""
    k0, k1 = key_halves(key)
    x = np.arange(vocab, dtype=np.uint32)
    x ^= np.uint32(k0)
    x = _mix(x)
    x += np.uint32(k1)
    return _mix(x)


# u takes the hash's top UNIT_BITS bits. 23, not 24: ``k + 0.5`` must be exact in
# float32, and with 24 bits the largest k rounded to 2**24, so u was exactly 1.0, its
# noise +inf, and that token won whatever its logit (a uniformly random token in about
# 0.3 % of a 49k-vocabulary model's draws; issue 18's client sweep, seen as numpy's
# divide-by-zero warning in the decode log).
UNIT_BITS = 23


def unit_open(h: np.ndarray) -> np.ndarray:
    """uint32 hashes -> float32 u = (k + 1/2) / 2**UNIT_BITS, k the top UNIT_BITS bits:
    exact, strictly inside (0, 1), so the noise is finite for every hash."""
    k = (h >> np.uint32(32 - UNIT_BITS)).astype(np.float32)
    return (k + np.float32(0.5)) * np.float32(2.0 ** -UNIT_BITS)


def gumbel(key: int, vocab: int) -> np.ndarray:
    """float32 Gumbel noise of the row, ``-log(-log(u))`` with u from ``unit_open``."""
    return -np.log(-np.log(unit_open(hash_u32(key, vocab))))


def nucleus_cut(x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """x: [m, V] fp32 logits; temperature [m] fp32 (> 0); top_p [m] fp64 in (0, 1].
    -> [m] fp32: the smallest logit of each row's nucleus, the fewest most likely
    tokens whose probability reaches top_p (ties with the last one stay in)."""
    x = torch.where(x.isnan(), float("-inf"), x)
    xs, _ = torch.sort(x, dim=-1, descending=True, stable=True)
    s = xs / temperature[:, None]
    w = torch.exp((s - s[:, :1]).double())                  # the largest is exp(0) = 1
    w = torch.where(w.isnan(), 0.0, w)                      # a row of -inf only
    units = torch.floor(w * 2.0 ** NUCLEUS_BITS).to(torch.int64)
    before = torch.cumsum(units, dim=-1) - units            # integers: exact in any order
    total = units.sum(dim=-1, keepdim=True).double()
    k = (before.double() < top_p[:, None] * total).sum(dim=-1).clamp_(min=1)
    return xs.gather(-1, (k - 1)[:, None]).squeeze(-1)


def _draw_host(x: torch.Tensor, temps: Sequence[float], top_ps: Sequence[float],
               keys: Sequence[int]) -> list[int]:
    out = []
    for i, (t, p, key) in enumerate(zip(temps, top_ps, keys, strict=True)):
        row = x[i]
        score = row.numpy().copy()
        if t > 0.0:
            if p < 1.0:
                cut = nucleus_cut(row[None], torch.tensor([t], dtype=torch.float32),
                                  torch.tensor([p], dtype=torch.float64)).numpy()[0]
                score[~(score >= cut)] = -np.inf
            score = score / np.float32(t) + gumbel(key, score.shape[0])
        score[np.isnan(score)] = -np.inf
        out.append(int(np.argmax(score)))
    return out


def _draw_device(x: torch.Tensor, temps: Sequence[float], top_ps: Sequence[float],
                 keys: Sequence[int]) -> list[int]:
    from engine.triton_draw import draw

    # Every per-row input in one host array and one asynchronous copy (a pageable
    # source is staged at once): a blocking copy would wait for the forward on the
    # stream, and one per input would add a round trip each. The kernel reads its
    # columns where they lie: no cast launches between the forward and the draw.
    n = len(temps)
    nucleus = [i for i, (t, p) in enumerate(zip(temps, top_ps, strict=True))
               if t > 0.0 and p < 1.0]
    host = np.zeros((n, 6), dtype=np.float64)        # t, top_p, k0, k1, nucleus rows, cut
    host[:, 0] = np.asarray(temps, dtype=np.float32)
    host[:, 1] = top_ps
    host[:, 2:4] = [key_halves(k) for k in keys]
    host[: len(nucleus), 4] = nucleus
    host[:, 5] = -np.inf
    dev = torch.from_numpy(host).to(x.device, non_blocking=True)
    if not FUSED:
        return _draw_device_unfused(x, dev, nucleus)
    if nucleus:
        idx = dev[: len(nucleus), 4].long()
        dev[idx, 5] = nucleus_cut(x[idx].float(), dev[idx, 0].float(), dev[idx, 1]).double()
    return draw(x, dev[:, 0], dev[:, 5], dev[:, 2:4]).tolist()


def _draw_device_unfused(x: torch.Tensor, dev: torch.Tensor, nucleus: list[int]) -> list[int]:
    """The device draw before issue 21 (``FUSED = False``, to time against): an
    fp32 copy of the logits, the inputs cast in three launches, the pick in torch."""
    from engine.triton_draw import draw

    x = x.float()
    t = dev[:, 0].float()
    cut = torch.full((x.shape[0],), float("-inf"), dtype=torch.float32, device=x.device)
    if nucleus:
        idx = dev[: len(nucleus), 4].long()
        cut[idx] = nucleus_cut(x[idx], t[idx], dev[:, 1][idx])
    return draw(x, t, cut, dev[:, 2:4].long(), fused=False).tolist()


def draw_rows(logits: torch.Tensor, temps: Sequence[float], top_ps: Sequence[float],
              keys: Sequence[int]) -> list[int]:
    """logits: [N, V] (rows beyond len(temps) ignored); per row its temperature
    (0: greedy), top_p and key. -> one token id per row; on CUDA, one sync."""
    n = len(temps)
    if not (len(top_ps) == len(keys) == n) or n > logits.shape[0]:
        raise ValueError(f"{n} temperatures, {len(top_ps)} top_p, {len(keys)} keys for "
                         f"{logits.shape[0]} rows of logits")
    if n == 0:
        return []
    if any(not (math.isfinite(t) and t >= 0.0) for t in temps):
        raise ValueError(f"temperatures must be finite and >= 0, got {list(temps)}")
    x = logits[:n]
    if x.is_cuda and _device_kernel():
        return _draw_device(x, temps, top_ps, keys)     # widened inside the kernel
    return _draw_host(x.float().cpu(), temps, top_ps, keys)


def _device_kernel() -> bool:
    try:
        import engine.triton_draw  # noqa: F401
    except ImportError:                 # no Triton: the host path (one copy of the batch)
        return False
    return True
