"""Every entry of ours applies common/process_env.py before it computes, in
fresh interpreters: passive OpenMP waiting is set at the moment the first
``import torch`` starts (the CLI, which starts every service; the engine as a
library; the benchmarks run as ``python -m benchmarks.…``), and freed MB-sized
buffers are reused without page faults unless the operator tuned malloc."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Records OMP_WAIT_POLICY when torch's import begins, then imports the entry.
PROBE = """
import importlib, importlib.abc, os, sys
seen = []
class First(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("OMP_WAIT_POLICY", "<unset>"))
        return None
sys.meta_path.insert(0, First())
for mod in sys.argv[1:]:
    importlib.import_module(mod)
print(seen[0] if seen else "<no torch>")
"""


# Page faults of 20 rounds of three 4 MiB buffers written and freed together
# (a layer's activations), after the imports.
FAULTS = """
import importlib, resource, sys
for mod in sys.argv[1:]:
    importlib.import_module(mod)
n = 4 << 20
def once():
    bufs = [bytearray(n) for _ in range(3)]
    for b in bufs:
        b[::4096] = bytes(len(range(0, n, 4096)))
once()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    once()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _run(code: str, *modules: str, **env_add: str) -> str:
    env = {k: v for k, v in os.environ.items()
           if k != "OMP_WAIT_POLICY" and not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", code, *modules], cwd=ROOT, env=env | env_add,
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip().splitlines()[-1]


def _policy_at_torch_import(*modules: str, **env_add: str) -> str:
    return _run(PROBE, *modules, **env_add)


@pytest.mark.parametrize("entry", [
    ("kvserve.cli", "prefill_svc.server"),      # `kvserve up` spawns every service through it
    ("engine", "engine.runner"),
    ("benchmarks", "benchmarks.prefill_ops"),
])
def test_passive_before_torch_loads(entry: tuple[str, ...]) -> None:
    assert _policy_at_torch_import(*entry) == "PASSIVE"


def test_an_operators_setting_is_kept() -> None:
    assert _policy_at_torch_import("kvserve.cli", "engine.runner",
                                   OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_buffers_are_reused_without_faulting_again() -> None:
    pages = 3 * (4 << 20) // 4096
    # Without the tuning glibc returns the freed heap top (past twice its
    # adaptive threshold) and every round faults its pages in again; with it
    # the heap keeps them.
    assert int(_run(FAULTS, "kvserve.cli")) < pages
    assert int(_run(FAULTS, "kvserve.cli", MALLOC_ARENA_MAX="2")) > 10 * pages
