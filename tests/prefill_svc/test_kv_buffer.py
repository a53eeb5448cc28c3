"""The prompt KV host buffer: byte pieces, private shared memory, checksums,
a lifetime bounded by memory rather than a clock."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest
import torch

from engine.staging import DeviceBudget, PinnedChunks
from service import kv_shm
from service.errors import HandleExpired, InvalidRequest
from service.kv_buffer import (
    HostAlloc,
    KVAssembler,
    KVBuffer,
    KVIntegrityError,
    KVPiece,
    KVShape,
    Resident,
    Upload,
)

SHM = "/dev/shm"
needs_shm = pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm on this machine")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _kv(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # [layers, 2, kv_heads, n, head_dim]
    return torch.arange(3 * 2 * 2 * n * 8, dtype=torch.float32).reshape(3, 2, 2, n, 8).to(dtype)


def _buf(max_bytes: int = 1 << 20, **kw: object) -> KVBuffer:
    kw.setdefault("chunk_bytes", 1 << 20)
    return KVBuffer(max_bytes=max_bytes, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pieces_reassemble_exactly(dtype: torch.dtype) -> None:
    kv = _kv(37, dtype)
    token_bytes = KVShape.of(kv).token_nbytes
    buf = _buf(chunk_bytes=64 * 1024)
    entry = buf.put("r1", kv, seed=7)
    assert entry is not None
    pieces = list(buf.pieces(entry))
    assert sum(p.token_count for p in pieces) == 37
    assert all(len(p.data) == p.token_count * token_bytes for p in pieces)
    assert all(p.checksum == kv_shm.piece_checksum(p.data, 7) for p in pieces)
    asm = KVAssembler(KVShape.of(kv), 37, seed=7)
    for p in pieces:
        asm.add(p)
    assert torch.equal(asm.done(), kv)


def test_small_chunks_split_along_tokens() -> None:
    kv = torch.randn(30, 2, 3, 100, 64)          # 46080 bytes per token
    buf = _buf(1 << 30, chunk_bytes=64 * 1024)
    entry = buf.put("r", kv, seed=1)
    assert entry is not None
    pieces = list(buf.pieces(entry))
    assert [p.token_count for p in pieces][:2] == [1, 1]
    assert len(pieces) == 100
    asm = KVAssembler(KVShape.of(kv), 100, seed=1)
    for p in pieces:
        asm.add(p)
    assert torch.equal(asm.done(), kv)


def test_a_piece_that_does_not_match_its_checksum_is_refused() -> None:
    """A flipped byte, a missing checksum, another handle's seed: each refused."""
    kv = _kv(8)
    buf = _buf()
    entry = buf.put("r", kv, seed=11)
    assert entry is not None
    (piece,) = buf.pieces(entry)
    flipped = bytearray(piece.data)
    flipped[5] ^= 1
    bad = [KVPiece(0, 8, bytes(flipped), checksum=piece.checksum),
           KVPiece(0, 8, piece.data),
           KVPiece(0, 8, piece.data, checksum=kv_shm.piece_checksum(piece.data, 12))]
    for p in bad:
        with pytest.raises(KVIntegrityError, match="checksum"):
            KVAssembler(KVShape.of(kv), 8, seed=11).add(p)
    asm = KVAssembler(KVShape.of(kv), 8, seed=11)
    asm.add(piece)
    assert torch.equal(asm.done(), kv)


@needs_shm
def test_shared_memory_file_is_private_and_verified_then_removed() -> None:
    kv = _kv(20)
    buf = _buf(shm_dir=SHM)
    entry = buf.put("r", kv, seed=3)
    assert entry is not None
    piece = buf.shm_piece(entry)
    assert piece.data == b"" and piece.size == kv.numel() * 4
    assert kv_shm.NAME.match(piece.shm_name)
    path = Path(SHM, piece.shm_name)
    st = path.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.getuid()
    assert buf.shm_piece(entry).shm_name == piece.shm_name      # written once
    asm = KVAssembler(KVShape.of(kv), 20, seed=3)
    assert asm.shm_usable(piece.shm_name)
    asm.add(piece)
    got = asm.done()
    assert torch.equal(got, kv)
    assert buf.release("r") is True
    assert not path.exists()
    assert buf.stats().bytes == 0
    # Decode holds its own copy: it outlives the file and no other reader sees it.
    assert torch.equal(got, kv)


@needs_shm
def test_a_tampered_shared_memory_file_is_detected() -> None:
    """The file's bytes are checked against the checksum taken from prefill's
    memory, so an edit after the write never reaches the engine."""
    kv = _kv(20)
    buf = _buf(shm_dir=SHM)
    entry = buf.put("r", kv, seed=99)
    assert entry is not None
    piece = buf.shm_piece(entry)
    fd = os.open(Path(SHM, piece.shm_name), os.O_WRONLY)
    try:
        os.pwrite(fd, b"\x00\x00\x80\x7f", 64)         # one float becomes +inf
    finally:
        os.close(fd)
    with pytest.raises(KVIntegrityError, match="does not match"):
        KVAssembler(KVShape.of(kv), 20, seed=99).add(piece)
    buf.close()


@needs_shm
def test_names_already_taken_are_never_opened(tmp_path: Path) -> None:
    """A pre-created file and a symlink planted at the next names are left alone:
    the buffer takes a fresh name (exclusive create, no link followed)."""
    planted = iter(["kvserve-kv-" + "a" * 32, "kvserve-kv-" + "b" * 32, "kvserve-kv-" + "c" * 32])
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    Path(SHM, "kvserve-kv-" + "a" * 32).write_bytes(b"attacker")
    Path(SHM, "kvserve-kv-" + "b" * 32).symlink_to(victim)
    try:
        buf = _buf(shm_dir=SHM, names=lambda: next(planted))
        entry = buf.put("r", _kv(4), seed=1)
        assert entry is not None
        piece = buf.shm_piece(entry)
        assert piece.shm_name == "kvserve-kv-" + "c" * 32
        assert Path(SHM, "kvserve-kv-" + "a" * 32).read_bytes() == b"attacker"
        assert victim.read_bytes() == b"keep"
        # The reader refuses a link or a file it does not own privately.
        asm = KVAssembler(KVShape.of(_kv(4)), 4, seed=1)
        assert not asm.shm_usable("kvserve-kv-" + "b" * 32)
        os.chmod(Path(SHM, "kvserve-kv-" + "a" * 32), 0o644)
        assert not asm.shm_usable("kvserve-kv-" + "a" * 32)
        buf.close()
        with pytest.raises(FileExistsError):
            _buf(shm_dir=SHM, names=lambda: "kvserve-kv-" + "a" * 32).shm_piece(
                _buf().put("x", _kv(4), seed=1))  # type: ignore[arg-type]
    finally:
        for n in ("a", "b", "c"):
            Path(SHM, "kvserve-kv-" + n * 32).unlink(missing_ok=True)


@needs_shm
def test_short_or_released_shared_memory_is_refused() -> None:
    kv = _kv(20)
    buf = _buf(shm_dir=SHM)
    entry = buf.put("r", kv, seed=5)
    assert entry is not None
    piece = buf.shm_piece(entry)
    os.truncate(Path(SHM, piece.shm_name), piece.size // 2)
    with pytest.raises(ValueError, match="short"):
        KVAssembler(KVShape.of(kv), 20, seed=5).add(piece)
    buf.release("r")
    gone = buf.put("g", kv, seed=5)
    assert gone is not None
    buf.release("g")                    # released before its first pull
    with pytest.raises(HandleExpired, match="released"):
        buf.shm_piece(gone)
    assert buf.stats().shm_files == 0


def test_no_clock_expiry_only_abandoned_entries_are_swept() -> None:
    """A handle waits as long as decode is backlogged; only one nobody pulled
    for ``abandon_s`` goes (decode would rebuild it), and each drop says why."""
    clock = Clock()
    buf = _buf(abandon_s=100, clock=clock)
    buf.put("a", _kv(4), seed=1)
    clock.t += 99
    buf.put("b", _kv(4), seed=1)
    assert buf.get("a").request_id == "a"
    clock.t += 2
    assert buf.sweep() == 1
    with pytest.raises(HandleExpired, match="never pulled; rebuild"):
        buf.get("a")
    assert buf.release("b") is True
    with pytest.raises(HandleExpired, match="released"):
        buf.get("b")
    assert buf.release("b") is False
    with pytest.raises(HandleExpired, match="never prefilled"):
        buf.get("zzz")
    assert buf.stats().abandoned == 1 and buf.stats().released == 1


def test_a_full_buffer_drops_the_oldest_for_the_newest() -> None:
    """Bounded by bytes: a put that needs room evicts the oldest entries, which
    decode then rebuilds; one larger than the whole buffer is not held at all."""
    one = _kv(16).numel() * 4
    buf = _buf(2 * one)
    buf.put("a", _kv(16), seed=1)
    buf.put("b", _kv(16), seed=1)
    buf.put("c", _kv(16), seed=1)
    with pytest.raises(HandleExpired, match="dropped for room; rebuild"):
        buf.get("a")
    assert buf.get("b") and buf.get("c")
    assert buf.stats().evicted == 1 and buf.bytes == 2 * one
    assert buf.put("huge", _kv(48), seed=1) is None
    with pytest.raises(HandleExpired, match="larger than the whole buffer"):
        buf.get("huge")
    assert buf.stats().unbuffered == 1 and buf.stats().entries == 2


def test_assembler_rejects_bad_pieces() -> None:
    kv = _kv(8)
    shape = KVShape.of(kv)
    buf = _buf()
    entry = buf.put("r", kv, seed=2)
    assert entry is not None
    (piece,) = list(buf.pieces(entry))
    asm = KVAssembler(shape, 9, seed=2)
    asm.add(piece)
    with pytest.raises(ValueError, match="ended after 8 of 9"):
        asm.done()
    with pytest.raises(ValueError, match="bytes"):
        KVAssembler(shape, 8, seed=2).add(KVPiece(0, 8, piece.data[:-4]))
    with pytest.raises(ValueError, match="bad shared-memory name"):
        KVAssembler(shape, 8, seed=2).add(KVPiece(0, 8, shm_name="../etc/passwd",
                                                  size=len(piece.data)))


@needs_shm
@pytest.mark.parametrize("first", [1, 16, 36])
def test_a_tail_pull_gives_exactly_the_tokens_after_what_decode_holds(first: int) -> None:
    """Decode's own G1 holds a session's earlier turn: only the tokens from
    ``first`` on travel, by bytes or by file, each verified, and every file
    goes with the entry."""
    kv = _kv(37)
    buf = _buf(shm_dir=SHM, chunk_bytes=1024)
    entry = buf.put("r", kv, seed=11)
    assert entry is not None
    pieces = list(buf.pieces(entry, first))
    assert pieces[0].start_token == first and sum(p.token_count for p in pieces) == 37 - first
    asm = KVAssembler(KVShape.of(kv), 37, seed=11, first=first)
    for p in pieces:
        asm.add(p)
    assert torch.equal(asm.done(), kv[:, :, :, first:, :])
    tail, whole = buf.shm_piece(entry, first), buf.shm_piece(entry)
    assert tail.size == (37 - first) * KVShape.of(kv).token_nbytes
    assert tail.shm_name != whole.shm_name and buf.stats().shm_files == 2
    asm = KVAssembler(KVShape.of(kv), 37, seed=11, first=first)
    asm.add(tail)
    assert torch.equal(asm.done(), kv[:, :, :, first:, :])
    with pytest.raises(ValueError, match="out of order"):     # a whole file for a tail
        KVAssembler(KVShape.of(kv), 37, seed=11, first=first).add(whole)
    buf.release("r")
    assert not Path(SHM, tail.shm_name).exists() and not Path(SHM, whole.shm_name).exists()


def test_a_pull_from_outside_the_prompt_is_refused() -> None:
    buf = _buf()
    entry = buf.put("r", _kv(8), seed=1)
    assert entry is not None
    for first in (-1, 8, 1 << 31):
        with pytest.raises(InvalidRequest, match="outside"):
            list(buf.pieces(entry, first))
    with pytest.raises(ValueError, match="outside"):
        KVAssembler(KVShape.of(_kv(8)), 8, seed=1, first=8)


class Engineish:
    """What a prefill engine does for a resident entry: it holds the prompt's
    KV until one copy-out (from a start token) or a release frees it."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv: torch.Tensor | None = kv
        self.copied: list[int] = []         # start tokens copied out
        self.released = 0

    async def materialize(self, start: int, alloc: HostAlloc,
                          on_device: bool = False) -> torch.Tensor | None:
        await asyncio.sleep(0)              # the engine thread's queue
        if self.kv is None:
            return None
        kv, self.kv = self.kv, None
        self.copied.append(start)
        tail = kv[:, :, :, start:, :]
        return alloc(tuple(tail.shape), tail.dtype).copy_(tail)     # as the engine does

    def release(self) -> None:
        if self.kv is not None:
            self.kv = None
            self.released += 1

    def resident(self) -> Resident:
        return Resident(self.materialize, self.release)


@needs_shm
def test_a_resident_entry_copies_out_only_the_tail_its_first_pull_asks_for() -> None:
    """No host bytes until the pull; then only tokens [first, n) leave the
    engine, once, however many pull at once, and serve bytes and files alike."""
    kv, first = _kv(37), 16

    async def body() -> None:
        buf = _buf(shm_dir=SHM, chunk_bytes=1024)
        eng = Engineish(kv)
        entry = buf.put_resident("r", 37, seed=5, resident=eng.resident())
        assert buf.bytes == 0 and buf.stats().resident == 1
        held, again = await asyncio.gather(buf.hold(entry, first), buf.hold(entry, first + 4))
        assert held is again is entry and eng.copied == [first]
        assert buf.bytes == (37 - first) * KVShape.of(kv).token_nbytes
        assert buf.stats().resident == 0
        asm = KVAssembler(KVShape.of(kv), 37, seed=5, first=first)
        for p in buf.pieces(entry, first):
            asm.add(p)
        assert torch.equal(asm.done(), kv[:, :, :, first:, :])
        later = first + 5
        asm = KVAssembler(KVShape.of(kv), 37, seed=5, first=later)
        piece = buf.shm_piece(await buf.hold(entry, later), later)
        asm.add(piece)
        assert torch.equal(asm.done(), kv[:, :, :, later:, :])
        # Tokens before what the entry holds were never copied out: decode rebuilds.
        with pytest.raises(HandleExpired, match="held from token 16 on only"):
            await buf.hold(entry, first - 1)
        with pytest.raises(HandleExpired, match="held from token 16"):
            list(buf.pieces(entry, 0))
        assert buf.release("r") and eng.released == 0      # already freed by the copy-out
        assert not Path(SHM, piece.shm_name).exists() and buf.bytes == 0

    asyncio.run(body())


def test_releasing_or_dropping_a_resident_entry_frees_the_engine_sequence() -> None:
    """Release, a replacing put, the sweep and eviction for room each free a
    resident prompt in the engine, and a late pull says why it went."""
    clock = Clock()

    async def body() -> None:
        one = _kv(16).numel() * 4
        buf = _buf(2 * one, clock=clock, abandon_s=100)
        engines = {rid: Engineish(_kv(16)) for rid in "abcd"}
        entries = {rid: buf.put_resident(rid, 16, seed=1, resident=e.resident())
                   for rid, e in engines.items()}
        assert buf.release("a") and engines["a"].released == 1
        with pytest.raises(HandleExpired, match="released"):
            await buf.hold(entries["a"], 0)
        assert engines["a"].copied == []
        buf.put_resident("b", 16, seed=2, resident=Engineish(_kv(16)).resident())
        assert engines["b"].released == 1                  # replaced: the old one freed
        clock.t += 101
        assert buf.sweep() == 3 and engines["c"].released == engines["d"].released == 1
        with pytest.raises(HandleExpired, match="never pulled"):
            buf.get("c")
        # A copy-out needing room drops the oldest host-held entry; an older resident
        # holds no host bytes, so it stays (demotion bounds residents, not bytes).
        old, new = Engineish(_kv(16)), Engineish(_kv(16))
        buf.put_resident("y", 16, seed=1, resident=old.resident())
        buf.put("x", _kv(16), seed=1)
        buf.put("w", _kv(16), seed=1)
        buf.put_resident("z", 16, seed=1, resident=new.resident())
        await buf.hold(buf.get("z"), 0)
        assert old.released == 0 and buf.stats().evicted == 1
        with pytest.raises(HandleExpired, match="dropped for room"):
            buf.get("x")
        assert buf.get("y").resident is not None and buf.bytes == 2 * one
        buf.close()
        assert old.released == 1 and buf.stats().entries == 0

    asyncio.run(body())


def test_a_demoted_resident_entry_holds_the_whole_prompt() -> None:
    """The service copied a resident entry out whole before its pull (``fill``):
    the pull's materialize finds nothing left in the engine and serves the
    host copy from any start; a failed copy-out is lost with its reason."""
    kv = _kv(20)

    async def body() -> None:
        buf = _buf()
        eng = Engineish(kv)
        res = eng.resident()
        entry = buf.put_resident("r", 20, seed=4, resident=res)
        whole, eng.kv = eng.kv, None                        # demoted: out whole, freed
        assert whole is not None and buf.fill(res, whole) is entry
        assert buf.fill(res, whole) is None                 # only once
        for first in (0, 7):
            got = await buf.hold(entry, first)
            (piece,) = buf.pieces(got, first)
            asm = KVAssembler(KVShape.of(kv), 20, seed=4, first=first)
            asm.add(piece)
            assert torch.equal(asm.done(), kv[:, :, :, first:, :])
        assert eng.copied == [] and buf.release("r") and eng.released == 0
        lost = Engineish(kv)
        gone = buf.put_resident("g", 20, seed=4, resident=lost.resident())
        buf.lose(gone.resident, "copy-out failed: boom; rebuild it")   # type: ignore[arg-type]
        with pytest.raises(HandleExpired, match="boom"):
            await buf.hold(gone, 0)
        huge = _buf(kv.numel() * 4 - 1)
        big = Engineish(kv)
        e = huge.put_resident("h", 20, seed=4, resident=big.resident())
        with pytest.raises(HandleExpired, match="larger than the whole buffer"):
            await huge.hold(e, 0)

    asyncio.run(body())


@needs_shm
def test_one_entrys_shm_write_does_not_hold_up_anothers() -> None:
    """Concurrent pulls of different prompts write their files at once: a
    buffer-wide lock queued every pull behind every other's 268 MB write
    (issue 18 run 7: 0.34 GB/s a pull on the H200 host). Entry a's write is
    held inside its file creation until entry b's whole pull is served."""
    import threading

    b_done = threading.Event()
    first = threading.Event()

    def names() -> str:
        if not first.is_set():              # entry a's file: wait for b's pull
            first.set()
            assert b_done.wait(10), "entry b's shared-memory pull waited for entry a's write"
        return kv_shm.new_name()

    buf = _buf(shm_dir=SHM, names=names)
    a, b = buf.put("a", _kv(20), seed=1), buf.put("b", _kv(12), seed=2)
    assert a is not None and b is not None
    got: dict[str, KVPiece] = {}
    ta = threading.Thread(target=lambda: got.__setitem__("a", buf.shm_piece(a)))
    ta.start()
    assert first.wait(10)
    got["b"] = buf.shm_piece(b)             # served while a's write is under way
    b_done.set()
    ta.join(10)
    assert not ta.is_alive() and set(got) == {"a", "b"}
    for rid, n, seed in (("a", 20, 1), ("b", 12, 2)):
        asm = KVAssembler(KVShape.of(_kv(n)), n, seed=seed)
        asm.add(got[rid])
        assert torch.equal(asm.done(), _kv(n))
    buf.close()
    assert not any(Path(SHM, got[r].shm_name).exists() for r in got)


@needs_shm
def test_a_resident_copy_out_lands_in_the_file_the_pull_reads(monkeypatch) -> None:
    """Issue 18 run 7: each hand-off copied the KV to fresh host memory, then
    wrote it to its /dev/shm file. Now the copy-out lands in a mapping of the
    file itself: no second write, the file goes with the entry, and decode's
    straight-to-device read (``Upload``) verifies what it read."""
    kv = _kv(40)

    def no_write(*_a: object, **_k: object) -> str:
        raise AssertionError("the hand-off file was written a second time")

    async def body() -> None:
        buf = _buf(shm_dir=SHM)
        entry = buf.put_resident("r", 40, seed=9, resident=Engineish(kv).resident())
        await buf.hold(entry, 0)
        assert entry.backing and Path(SHM, entry.backing).exists()
        monkeypatch.setattr(kv_shm, "create_private", no_write)
        piece = buf.shm_piece(entry, 0)
        assert piece.shm_name == entry.backing
        assert stat.S_IMODE(os.stat(Path(SHM, piece.shm_name)).st_mode) == 0o600
        budget = DeviceBudget(1 << 20)
        up = Upload(torch.device("cpu"), PinnedChunks(sets=1, chunk_bytes=1000, pin=False),
                    budget)
        asm = KVAssembler(KVShape.of(kv), 40, seed=9, upload=up)
        asm.add(piece)
        got = asm.done()
        assert torch.equal(got, kv) and budget.used == got.numel() * 4
        del got, asm
        assert budget.used == 0
        # A byte changed in the file after prefill took its checksum: refused.
        with open(Path(SHM, piece.shm_name), "r+b") as f:
            f.seek(123)
            f.write(b"\xff")
        with pytest.raises(KVIntegrityError):
            KVAssembler(KVShape.of(kv), 40, seed=9, upload=up).add(piece)
        assert budget.used == 0
        assert buf.release("r") and not Path(SHM, piece.shm_name).exists()

    asyncio.run(body())


@needs_shm
def test_a_copy_out_file_goes_when_its_entry_went_meanwhile() -> None:
    kv = _kv(12)

    async def body() -> None:
        buf = _buf(shm_dir=SHM)
        eng = Engineish(kv)
        made: list[str] = []
        real = buf.host_alloc

        def spy(dims: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, str]:
            t, name = real(dims, dtype)
            made.append(name)
            buf.release("r")                # the entry goes while the copy runs
            return t, name

        buf.host_alloc = spy                # type: ignore[method-assign]
        entry = buf.put_resident("r", 12, seed=1, resident=eng.resident())
        with pytest.raises(HandleExpired):
            await buf.hold(entry, 0)
        assert made and not Path(SHM, made[0]).exists()

    asyncio.run(body())


def test_files_a_killed_prefill_left_are_swept_at_the_next_start(tmp_path: Path) -> None:
    """A hand-off file whose creator was killed (SIGKILL: nothing unlinked it)
    goes when the next buffer starts on that directory; a live process's file,
    one of another pid namespace, a bare-named one and another name stay."""
    import subprocess
    import sys

    dead = subprocess.run(  # a real process that creates a hand-off file, then dies unclean
        [sys.executable, "-c", "import os, sys; from pathlib import Path; "
         "from service import kv_shm; "
         "print(kv_shm.create_private(Path(sys.argv[1]), memoryview(b'kv' * 64))); "
         "sys.stdout.flush(); os._exit(9)", str(tmp_path)],
        capture_output=True, text=True, check=False, cwd=Path(__file__).parents[2])
    orphan = dead.stdout.strip()
    assert dead.returncode == 9 and kv_shm.NAME.match(orphan), dead.stderr
    live = kv_shm.create_private(tmp_path, memoryview(b"mine"))
    ns = int(kv_shm.NAME.match(live).group(1), 16)                  # type: ignore[union-attr]
    other_ns = f"kvserve-kv-{ns + 1:x}-{orphan.split('-')[3]}-" + "d" * 32
    bare = "kvserve-kv-" + "e" * 32
    for name in (other_ns, bare, "unrelated"):
        (tmp_path / name).write_bytes(b"x")
    _buf(shm_dir=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([live, other_ns, bare, "unrelated"])
