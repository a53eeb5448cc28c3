"""What each process of `kvserve up` imports before it can answer: the router
and the launcher never compute, so they must not load torch (seconds of every
start on a 2-core machine), and the engines must not load torch._dynamo,
which only a CUDA prefill path uses. Each check runs in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _modules_after(code: str) -> set[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("code", [
    "import router.serve",
    "import kvserve.launcher",
    "from engine.fetch import fetch_model\nfrom engine.config import read_config",
    "from engine.grammar import GrammarSpec, validate\n"
    "validate(GrammarSpec('regex', '[a-z]+'))",
])
def test_processes_that_never_compute_do_not_load_torch(code: str) -> None:
    assert "torch" not in _modules_after(code)


def test_engine_services_do_not_load_dynamo() -> None:
    mods = _modules_after("import decode_svc.server\nimport prefill_svc.server")
    assert "torch" in mods
    assert "torch._dynamo" not in mods


def test_engine_exports_load_on_first_use() -> None:
    mods = _modules_after("import engine.errors\nfrom engine import EngineInputError")
    assert "engine.runner" not in mods and "torch" not in mods
    mods = _modules_after("from engine import Engine, SamplingParams, bik")
    assert {"engine.runner", "engine.sampling", "engine.bik"} <= mods
    bad = subprocess.run([sys.executable, "-c", "import engine\nengine.NoSuchThing"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0
    assert "AttributeError: module 'engine' has no attribute 'NoSuchThing'" in bad.stderr
