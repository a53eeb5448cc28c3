"""Where the project's shared data (traces, expert-load recordings) lives.

CI clones the repository into some folder with ``shared/`` beside it, so the
data is found relative to the checkout first; ``KVSERVE_SHARED`` overrides.
"""

from __future__ import annotations

import os
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    env = os.environ.get("KVSERVE_SHARED")
    candidates = [Path(env)] if env else []
    candidates += [_ROOT.parent / "shared", _ROOT / "shared", Path("/work/shared")]
    for c in candidates:
        if (c / "traces").is_dir():
            return c
    return candidates[0]


SHARED = shared_dir()
