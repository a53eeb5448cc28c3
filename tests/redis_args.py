"""How tests hand a Redis URL (with its password) to a child process: a 0600
file named by ``--redis-url-file``, as kvserve's own launchers do; a URL with
a password on a command line is refused (security/flags.py)."""

from __future__ import annotations

import atexit
import hashlib
import shutil
import tempfile

from security.secret_files import redis_url_args

_DIR = tempfile.mkdtemp(prefix="kvserve-test-redis-")      # 0700, this process only
atexit.register(shutil.rmtree, _DIR, True)


def redis_args(url: str) -> list[str]:
    """``["--redis-url-file", FILE]`` for ``url`` (one file per distinct URL)."""
    name = hashlib.sha256(url.encode()).hexdigest()[:16] + ".url"
    return redis_url_args(url, _DIR, name)
