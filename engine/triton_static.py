"""What the batch-invariant kernels compile to on Hopper, without a GPU: Triton
builds sm_90 code offline (its wheel carries ptxas and cuobjdump), so each
kernel variant's matrix instruction, warp layout, pipelining, registers and
spills are read here at no device time.

``python3 -m engine.triton_static`` prints one line per variant:
- ``mma``: the SASS matrix instructions (HGMMA = Hopper warpgroup MMA, the one
  family every 16-bit plan must stay on; HMMA = the older, slower path);
- ``warps``: the accumulator layout's warpsPerCTA (warps along M only keeps a
  row inside one warp's shuffles);
- ``cp``: asynchronous copies (cp.async or TMA) in the TTGIR (0 = the K loop
  is not pipelined);
- ``smem`` bytes, ``regs`` per thread and ``local`` bytes (spills).

Arguments are specialised as Triton's launcher does for real tensors (pointers
and multiples of 16 marked 16-divisible, 1 folded to a constant), so the code
is what the device would build, up to Triton's version (the H200 image has 3.6).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)


@dataclass(frozen=True, slots=True)
class Build:
    name: str
    mma: str
    warps: str
    async_copies: int
    smem: int
    regs: int
    local: int

    def line(self) -> str:
        return (f"{self.name:<44} {self.mma:<26} {self.warps:<8} cp={self.async_copies:<3} "
                f"smem={self.smem:<7} regs={self.regs:<4} local={self.local}")


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def compile_offline(fn: triton.JITFunction, args: dict[str, object], constexprs: dict[str, object],
                    warps: int, stages: int) -> dict[str, object]:
    """``args``: every runtime argument by name: a type string for pointers
    ("*bf16") or a sample int/float specialised as the launcher would."""
    sig: dict[str, str] = {}
    consts = dict(constexprs)
    attrs: dict[tuple[int, ...], list[list[object]]] = {}
    names = fn.arg_names
    # constexprs with a default the launcher leaves out (PDL) take it here too
    defaults = {n: q.default for n, q in inspect.signature(fn.fn).parameters.items()
                if q.default is not inspect.Parameter.empty}
    for i, name in enumerate(names):
        if name not in constexprs and name not in args and name in defaults:
            consts[name] = defaults[name]
        if name in consts:
            sig[name] = "constexpr"
            continue
        v = args[name]
        if isinstance(v, str):
            sig[name] = v
            if v.startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        elif v == 1 and name not in fn.do_not_specialize:
            sig[name] = "constexpr"
            consts[name] = 1
        else:
            sig[name] = "i32"
            if isinstance(v, int) and v % 16 == 0 and name not in fn.do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=HOPPER, options={"num_warps": warps, "num_stages": stages})
    return {"ttgir": k.asm["ttgir"], "cubin": k.asm["cubin"], "shared": k.metadata.shared}


def inspect_build(name: str, built: dict[str, object]) -> Build:
    ttgir = str(built["ttgir"])
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(built["cubin"])  # type: ignore[arg-type]
        f.flush()
        res = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "--dump-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", res).group(1))             # type: ignore[union-attr]
    local = int(re.search(r"LOCAL:(\d+)", res).group(1))          # type: ignore[union-attr]
    kinds = sorted(set(re.findall(r"\b(HGMMA\.\w+|HMMA\.\w+)", sass)))
    warps = re.findall(r"nvidia_mma<\{[^}]*warpsPerCTA = \[(\d+), (\d+)\]", ttgir)
    return Build(name, ",".join(kinds) or "none(FMA)",
                 ";".join(sorted({f"{a}x{b}" for a, b in warps})) or "-",
                 ttgir.count("async_copy_global_to_local") + ttgir.count("async_tma_copy"),
                 int(built["shared"]), regs, local)  # type: ignore[call-overload]


def reduce_ops(ttgir: str) -> set[str]:
    """The combining operation of every reduction in the TTGIR."""
    return set(re.findall(r'"tt\.reduce"\(.*?\n\s*%\S+ = (\S+) ', ttgir, re.S))


def gemm_builds(dtype: str = "bf16") -> list[Build]:
    from engine import triton_gemm as tg

    out = []
    shapes = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
              "down": (14336, 4096), "lm_head": (4096, 128256)}
    seen = set()
    for m in (1, 64, 512, 2048):
        for wname, (k, n) in shapes.items():
            p = tg.PLANS[{"bf16": __import__("torch").bfloat16}[dtype]](m, n)
            if p in seen:
                continue
            seen.add(p)
            b = compile_offline(tg._gemm_kernel, {
                "A": f"*{dtype}", "B": f"*{dtype}", "BIAS": f"*{dtype}", "C": f"*{dtype}",
                "M": m, "N": n, "K": k, "s_am": k, "s_ak": 1, "s_bk": 1, "s_bn": k, "s_cm": n},
                {"HAS_BIAS": False, "EVEN_K": True, "BM": p.bm, "BN": p.bn, "BK": tg.BK,
                 "GROUP_M": p.group_m, "PREC": "tf32"}, p.warps, p.stages)
            out.append(inspect_build(f"gemm M={m} {wname} {p.bm}x{p.bn} w{p.warps} s{p.stages}",
                                     b))
    for p in (tg.GemmPlan(128, 256, 8, 3, persistent=True),):      # a candidate (triton_tune)
        b = compile_offline(tg._gemm_tma_kernel, {
            "a_desc": f"tensordesc<{dtype}[{p.bm}, {tg.BK}]>",
            "b_desc": f"tensordesc<{dtype}[{p.bn}, {tg.BK}]>", "BIAS": f"*{dtype}",
            "C": f"*{dtype}", "M": 2048, "N": 6144, "K": 4096, "s_cm": 6144},
            {"HAS_BIAS": False, "BM": p.bm, "BN": p.bn, "BK": tg.BK, "GROUP_M": p.group_m,
             "NUM_SMS": 132}, p.warps, p.stages)
        out.append(inspect_build(f"gemm TMA persistent {p.bm}x{p.bn} w{p.warps} s{p.stages}", b))
    return out


def attention_builds(dtype: str = "bf16", dim: int = 128, group: int = 4) -> list[Build]:
    """Prefill and decode programs; raises if either reduces anything over keys
    but a maximum (exact in any order): the row sums are matrix-unit products
    with ones, so a decode row can give a prefill row's bits whatever each
    program's layout."""
    from engine import triton_attention as ta

    out = []
    ops: dict[str, set[str]] = {}
    gp = triton.next_power_of_2(group)
    common: dict[str, object] = {
        "Q": f"*{dtype}", "KP": f"*{dtype}", "VP": f"*{dtype}", "TBL": "*i32", "SEG": "*i32",
        "OUT": f"*{dtype}", "s_qm": 48 * dim, "s_qh": dim, "s_kh": 4096 * 64 * dim,
        "s_om": 32 * dim, "window": 0, "qk_scale": 0.1, "block_tokens": 64}
    prec = "tf32" if dtype != "fp32" else "ieee"
    tps = ta.KEY_SPLIT // ta.KEY_TILE
    for stages in (2, 3):
        b = compile_offline(ta._attn_kernel, {**common, "TILE": "*i32"}, {
            "G": group, "GP": gp, "TQ": ta.tile_tokens(group, ta.PREFILL_ROWS), "D": dim,
            "BN": ta.KEY_TILE, "TPS": tps, "PREC": prec}, ta.PREFILL_ROWS // 16, stages)
        out.append(inspect_build(f"attn {dtype} D={dim} prefill rows={ta.PREFILL_ROWS} "
                                 f"s{stages}", b))
        ops[f"prefill s{stages}"] = reduce_ops(str(b["ttgir"]))
    for label, parts in (("decode", 1), ("decode-split", 4)):
        for sch in (ta.DECODE, ta.AHEAD_DECODE):
            b = compile_offline(ta._decode_kernel, {
                **common, "ACC": "*fp32", "ML": "*fp32", "s_ab": 4 * 32 * dim, "s_ap": 32 * dim,
                "s_ah": dim, "s_mb": 4 * 32 * 2, "s_mp": 32 * 2, "s_mh": 2}, {
                "G": group, "NQ": max(ta.DECODE_COLS, gp), "D": dim, "BN": ta.KEY_TILE,
                "TPS": tps, "PARTS": parts, "PREC": prec, "LOOP": sch.loop}, sch.warps,
                sch.stages)
            out.append(inspect_build(f"attn {dtype} D={dim} {label} {sch}", b))
            ops[f"{label} {sch}"] = reduce_ops(str(b["ttgir"]))
    # the split fold (no reduction at all)
    b = compile_offline(ta._fold_splits, {
        "SEG": "*i32", "ACC": "*fp32", "ML": "*fp32", "OUT": f"*{dtype}", "s_ab": 4 * 32 * dim,
        "s_ap": 32 * dim, "s_ah": dim, "s_mb": 4 * 32 * 2, "s_mp": 32 * 2, "s_mh": 2,
        "s_om": 32 * dim, "window": 0}, {
        "G": group, "GP": gp, "D": dim, "BN": ta.KEY_TILE, "TPS": tps},
        4, 3)
    out.append(inspect_build(f"attn {dtype} D={dim} split fold", b))
    if any(not o or not o <= {"arith.maxnumf", "arith.maximumf"} for o in ops.values()):
        raise AssertionError(f"a reduction over keys other than a maximum: {ops}")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", nargs="*", default=["gemm", "attention"])
    a = p.parse_args(argv)
    builders = {"gemm": [gemm_builds], "attention": [
        attention_builds, lambda: attention_builds("bf16", 64, 3),      # llama-8b, smollm2
        lambda: attention_builds("fp32", 16, 2)]}                       # tiny fp32 models
    for what in a.what:
        for build in builders[what]:
            for b in build():
                print(b.line(), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
