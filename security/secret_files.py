"""Secrets travel in files, never in argv, the environment of children or a
config file: one place to write them (0600, created with that mode) and one
to read them (refusing world-readable files, empty values and the
placeholders our examples ship with, naming the setting).

Kubernetes mounts a Secret as files of mode 0440 (group = the pod's fsGroup),
so group-readable is accepted; world-readable never is.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlsplit

from security.redact import register_secret

# What our example manifests and docs ship where a secret belongs; a deployment
# that still has one of these has not been configured, and must not start.
_PLACEHOLDER = re.compile(
    r"replace[-_ ]?me|change[-_ ]?me|placeholder|your[-_ ]?(password|secret|key)|"
    r"^<.*>$|^x{4,}$|^\*+$", re.IGNORECASE)
_WEAK = frozenset({"password", "secret", "redis", "default", "admin", "kvserve", "test",
                   "pass", "123456", "changeit", "none", "null"})


class SecretFileError(ValueError):
    """A secret that is missing, unreadable, too open, empty or a placeholder;
    the message names the setting it came from."""


def refuse_placeholder(value: str, setting: str) -> str:
    """``value`` if it looks like a real secret; SecretFileError naming
    ``setting`` when it is empty, a shipped placeholder or a default word."""
    v = value.strip()
    if not v:
        raise SecretFileError(f"{setting} is empty: set a real secret")
    if _PLACEHOLDER.search(v) or v.lower() in _WEAK:
        raise SecretFileError(f"{setting} still holds a placeholder or default value; "
                              "replace it with a random secret (docs/security.md)")
    return value


def check_url_secret(url: str, setting: str) -> str:
    """A URL whose password (if any) is not a placeholder; registers it for redaction."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError as exc:
        raise SecretFileError(f"{setting}: not a URL ({exc.__class__.__name__})") from None
    if password is not None:
        refuse_placeholder(unquote(password), f"the password in {setting}")
        register_secret(password)
        register_secret(unquote(password))
    return url


def read_secret_text(path: str | Path, setting: str, *, whole_value: bool = True) -> str:
    """The stripped text of a secret file; refuses a world-readable file, an
    empty one and (``whole_value``: the file is one secret) a placeholder,
    which is then registered for redaction."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        # A symlink is fine where Kubernetes made it (..data links); follow it
        # only after checking the target below.
        if exc.errno != errno.ELOOP:     # the last component is a link
            raise SecretFileError(f"{setting}: cannot read {p}: {exc.strerror}") from None
        fd = os.open(p.resolve(), os.O_RDONLY | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if mode & stat.S_IROTH:
            raise SecretFileError(f"{setting}: {p} is readable by every local user (mode "
                                  f"{stat.S_IMODE(mode):o}); chmod 600 it")
        text = f.read().decode("utf-8", "replace").strip()
    if whole_value:
        refuse_placeholder(text, f"{setting} ({p})")
        register_secret(text)
    return text


def write_private(path: str | Path, data: str | bytes, *, mode: int = 0o600) -> Path:
    """Write ``data`` to ``path`` atomically with ``mode`` from the first byte
    (a temporary file in the same directory, renamed over the target), parents
    made 0700. A reader sees the old or the new file, never half of one."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return p


def redis_url_args(url: str, directory: str | Path, name: str = "redis.url") -> list[str]:
    """Command-line flags that hand a child ``url`` through a 0600 file in
    ``directory`` (``--redis-url-file``), never the URL itself."""
    path = write_private(Path(directory) / name, url + "\n")
    return ["--redis-url-file", str(path)]


__all__ = ["SecretFileError", "check_url_secret", "read_secret_text", "redis_url_args",
           "refuse_placeholder", "write_private"]
