"""Engine-level SmolLM2 speeds on this CPU for the kvserve code on PYTHONPATH:
cold prefill of 1,493 tokens, warm prefill of it (1,472 tokens in G1), decode
tokens/s alone and aggregate over 8 sequences (contexts of ~1.4k tokens).

    flock /tmp/kvserve-heavy.lock sh -c 'for c in /tmp/base .; do \
        PYTHONPATH=$c python scripts/engine_speeds.py $c; done'

Prints one line per run; medians of 3 prefills after one unmeasured first
(kernel warm-up, weight packing).
"""

from __future__ import annotations

import random
import statistics
import sys
import time

from engine import Engine, EngineConfig, SamplingParams
from engine.fetch import fetch_model
from kvstore.keys import chain_keys


def main(label: str) -> None:
    eng = Engine(EngineConfig(model=str(fetch_model("smollm2")), block_tokens=64,
                              num_blocks=1024))
    rng = random.Random(1)

    def prompt(n: int = 1493) -> list[int]:
        return [rng.randrange(100, 49152) for _ in range(n)]

    def keys(t: list[int]) -> list[bytes]:
        return chain_keys(t, block_tokens=64, tenant="t", fingerprint=eng.fingerprint,
                          secret=b"s" * 32)

    eng.prefill("first", prompt(128))
    eng.free("first")
    cold, warm = [], []
    for _ in range(3):
        p = prompt()
        k = keys(p)
        t = time.perf_counter()
        eng.prefill("c", p, block_keys=k)
        cold.append(time.perf_counter() - t)
        eng.free("c", keep_keys=k)
        t = time.perf_counter()
        eng.prefill("w", p, block_keys=k)
        warm.append(time.perf_counter() - t)
        eng.free("w", keep_keys=k)
    sp = SamplingParams(max_tokens=64, ignore_eos=True)
    ids = [f"d{i}" for i in range(8)]
    for sid in ids:
        eng.prefill(sid, prompt(1400), sampling=sp)
    eng.decode_step(ids[:1])
    t = time.perf_counter()
    for _ in range(16):
        eng.decode_step(ids[:1])
    alone = 16 / (time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(8):
        eng.decode_step(ids)
    eight = 64 / (time.perf_counter() - t)
    print(f"{label}: cold {statistics.median(cold):.2f}s warm {statistics.median(warm):.3f}s "
          f"decode alone {alone:.1f} tok/s, 8 concurrent {eight:.1f} tok/s (aggregate)",
          flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "kvserve")
