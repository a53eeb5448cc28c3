"""Engine test fixtures. Tests run torch on one thread: the CI machine has two
cores shared with servers other tests start, and an oversubscribed OpenMP
pool makes small ops 10-50x slower (measured on cpu-2c)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine import Engine, EngineConfig

TINY = ("tiny-dense", "tiny-hybrid", "tiny-moe")


@pytest.fixture(scope="package", autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_engine(model: str, **kw: object) -> Engine:
    opts: dict[str, object] = {"block_tokens": 16, "num_blocks": 512}
    opts.update(kw)
    return Engine(EngineConfig(model=model, **opts))  # type: ignore[arg-type]


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        out.append(torch.randint(0, vocab, (length,), generator=g).tolist())
    return out
