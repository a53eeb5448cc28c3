"""Private shared-memory files for the prefill -> decode KV hand-off, and the
checksum every hand-off piece carries.

A file is created 0600 with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under a name
with 128 random bits: another local user can neither read it nor pre-create
(or symlink) the name to catch or edit the write (``/dev/shm`` is a shared
sticky directory, and ``fs.protected_regular`` may be 0). The reader opens it
with ``O_NOFOLLOW`` and takes only a regular file owned by its own uid with no
group or other permission bits.

None of that makes the bytes trustworthy by itself (the same uid can still
write them): decode verifies every piece against ``piece_checksum``, which
prefill computes from its own memory and sends over the authenticated gRPC
channel, seeded with a per-handle secret (``KVHandle.kv_seed``).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

import xxhash

# kvserve-kv-<pid namespace>-<pid>-<128 random bits>: the creator's identity lets a
# later prefill remove what a killed one left (``sweep_orphans``); the bare form
# (no creator) is still read.
NAME = re.compile(r"^kvserve-kv-(?:([0-9a-f]{1,16})-([0-9]{1,10})-)?[0-9a-f]{32}$")
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE_RW = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_ATTEMPTS = 4                       # fresh names tried when one is taken


class ShmRefused(OSError):
    """The file is not one this process may trust to read (wrong owner, mode, type)."""


def pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:                 # no procfs: one namespace as far as we can tell
        return 0


def new_name() -> str:
    return f"kvserve-kv-{pid_namespace():x}-{os.getpid()}-{secrets.token_hex(16)}"


def sweep_orphans(directory: Path) -> int:
    """Remove hand-off files whose creating process is gone (a prefill killed
    before it could unlink them: SIGKILL, the OOM killer), so a crash does not
    hold their memory until reboot. Only this user's regular files named by a
    process of this pid namespace (another container sharing the directory
    has other pids) that no longer exists; returns how many went."""
    ns, me, uid, gone = pid_namespace(), os.getpid(), os.getuid(), 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        m = NAME.match(name)
        if m is None or m.group(1) is None or int(m.group(1), 16) != ns:
            continue
        pid = int(m.group(2))
        if pid == me or alive(pid):
            continue
        path = directory / name
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
                path.unlink()
                gone += 1
        except OSError:
            continue
    return gone


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:         # another user's process: alive
        return True
    return True


def piece_checksum(data: object, seed: int) -> bytes:
    """16-byte xxh3-128 of a bytes-like ``data``, seeded with the handle's secret."""
    return xxhash.xxh3_128_digest(data, seed=seed)  # type: ignore[arg-type]


def _create_fresh(directory: Path, flags: int, names: Callable[[], str]) -> tuple[Path, int]:
    """A new 0600 file under a fresh name and its descriptor (the caller closes
    it). A name that exists already (someone else's file or link) is never
    opened: another name is tried."""
    for _ in range(_ATTEMPTS):
        path = directory / names()
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            continue
        try:
            os.fchmod(fd, 0o600)            # whatever the umask did
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return path, fd
    raise FileExistsError(f"no free hand-off name in {directory} after {_ATTEMPTS} tries")


def create_private(directory: Path, data: memoryview,
                   names: Callable[[], str] = new_name) -> str:
    """Write ``data`` to a new 0600 file under a fresh name; returns the name."""
    path, fd = _create_fresh(directory, _CREATE, names)
    try:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view):]
    except BaseException:
        path.unlink(missing_ok=True)        # never leave a torn file behind
        raise
    finally:
        os.close(fd)
    return path.name


def create_mapped(directory: Path, size: int,
                  names: Callable[[], str] = new_name) -> tuple[str, mmap.mmap]:
    """A new 0600 file of ``size`` bytes under a fresh name, mapped shared and
    writable: prefill copies the KV straight into the mapping, so the file is
    written by that one copy (no private buffer first, no write(2) after).
    Same naming and refusal rules as ``create_private``."""
    if size < 1:
        raise ValueError(f"a hand-off file needs bytes, got {size}")
    path, fd = _create_fresh(directory, _CREATE_RW, names)
    try:
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)                        # the mapping stays valid without it
    return path.name, mapped


def open_private(directory: Path, name: str) -> int:
    """A read-only descriptor of hand-off file ``name`` (checked as
    ``read_private`` checks it); the caller closes it."""
    if not NAME.match(name):
        raise ValueError(f"bad shared-memory name {name!r}")
    return _open_checked(directory / name)


def _open_checked(path: Path) -> int:
    fd = os.open(path, _OPEN)
    st = os.fstat(fd)
    if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid()
            or st.st_mode & 0o077):
        os.close(fd)
        raise ShmRefused(f"hand-off file {path.name} is not a private file of this user "
                         f"(mode {stat.filemode(st.st_mode)}, uid {st.st_uid})")
    return fd


def usable(directory: Path, name: str) -> bool:
    """Whether ``name`` is a hand-off file this process may read here (same host,
    same user); when not, the reader asks for a byte stream instead."""
    if not NAME.match(name):
        return False
    try:
        os.close(_open_checked(directory / name))
    except OSError:
        return False
    return True


def read_private(directory: Path, name: str, offset: int, out: memoryview) -> None:
    """Fill ``out`` with the file's bytes from ``offset`` (a copy: what is
    verified afterwards cannot change under the reader)."""
    if not NAME.match(name):
        raise ValueError(f"bad shared-memory name {name!r}")
    if offset < 0:
        raise ValueError(f"shared-memory offset {offset} is negative")
    fd = _open_checked(directory / name)
    try:
        size = os.fstat(fd).st_size
        want = len(out)
        if size < offset + want:
            raise ValueError(f"shared-memory file {name} is short: {size} of "
                             f"{offset + want} bytes")
        view = out.cast("B")
        pos = offset
        while view:
            n = os.preadv(fd, [view], pos)
            if n <= 0:
                raise ValueError(f"shared-memory file {name} is short at byte {pos}")
            view, pos = view[n:], pos + n
    finally:
        os.close(fd)
