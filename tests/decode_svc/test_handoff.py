"""The prefill -> decode KV hand-off against real processes: a private file
that nobody else can read, every piece verified before adoption (a tampered
one is recomputed, never served or stored), a handle that waits for its
decode however late, and a decode queue that refuses up front when full."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from proto import decode_pb2, prefill_pb2
from service import kv_shm
from tests.decode_svc.stack import (
    TIMEOUT,
    Stack,
    decode,
    keys_of,
    prefill,
    prompt,
    reference,
    sampling,
    wait_stored,
)
from tests.prefill_svc import procs

SHM = Path("/dev/shm")
HANDOFF = kv_shm.NAME
# Hand-off files of builds before the private-file change (other checkouts on a
# shared machine may still run them): not this build's files, so not checked here.
LEGACY = re.compile(r"^kvserve-kv-[0-9]+-[0-9]+$")
NOBODY = 65534


def _metric(stack_proc: procs.Proc, name: str) -> float:
    return stack_proc.metrics().get(name, 0.0)


def _readable_by_nobody(path: Path) -> bool:
    """Whether uid/gid 65534 can open ``path`` for reading (run as root: really
    tried in a child that drops to that uid; otherwise read from the mode bits)."""
    if os.getuid() != 0:
        return bool(path.lstat().st_mode & 0o004)
    code = (f"import os, sys; os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})\n"
            "try:\n    os.close(os.open(sys.argv[1], os.O_RDONLY | os.O_NOFOLLOW))\n"
            "except OSError:\n    sys.exit(1)\n")
    return subprocess.run([sys.executable, "-c", code, str(path)], check=False).returncode == 0


def private_tree_problems(root: Path, *, skip: re.Pattern[str] | None = None) -> list[str]:
    """Entries under ``root`` owned by this uid that another uid could read or
    write (files: group/other bits; directories: group/other write, or read
    without being this process's own private directory)."""
    bad = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*filenames, *dirnames]:
            if skip is not None and skip.match(name):
                continue
            p = Path(dirpath, name)
            try:
                st = p.lstat()
            except FileNotFoundError:            # removed while we walked
                continue
            if st.st_uid != os.getuid() or stat.S_ISLNK(st.st_mode):
                continue
            if stat.S_IMODE(st.st_mode) & 0o077:
                bad.append(f"{p} {stat.filemode(st.st_mode)}")
    return bad


def test_a_tampered_handoff_file_is_recomputed_never_served_nor_stored(stack: Stack) -> None:
    p = prompt(61, 45)
    want = reference(stack.ref, p, 8)
    pre = stack.prefill_stub()
    h = prefill(pre, p, max_tokens=8)
    assert h.kv_seed and h.expires_at == 0
    # Have prefill write the shared-memory file now (as decode's pull would), then
    # edit it as a local attacker with write access would, before decode reads it.
    (chunk,) = list(pre.PullKV(prefill_pb2.PullKVRequest(request_id=h.ctx.request_id,
                                                         use_shm=True), timeout=TIMEOUT))
    assert HANDOFF.match(chunk.shm_name) and len(chunk.checksum) == 16
    path = SHM / chunk.shm_name
    assert stat.S_IMODE(path.lstat().st_mode) == 0o600
    assert not _readable_by_nobody(path)
    with open(path, "r+b") as f:
        f.seek(chunk.size // 3)
        f.write(b"\x7f" * 256)
    before = {k: _metric(stack.decode, k) for k in (
        "kvserve_decode_decode_kv_integrity_failures_total",
        "kvserve_decode_decode_rebuilds_total{kind=integrity}")}
    out = decode(stack.decode_stub(), h, max_tokens=8)
    assert out.tokens == want                      # recomputed: the clean run's tokens
    for k, v in before.items():
        assert _metric(stack.decode, k) == v + 1, k
    # The file goes with the release; the warehouse got the recomputed blocks, not
    # the tampered ones: the next turn restores them and still answers exactly.
    deadline = time.monotonic() + 10
    while path.exists():
        assert time.monotonic() < deadline, "the tampered file outlived the request"
        time.sleep(0.05)
    nxt = p + out.tokens + prompt(62, 20)
    wait_stored(stack.store.address, keys_of(stack.ref, nxt), len(p) // procs.BLOCK, len(nxt))
    h2 = prefill(pre, nxt, max_tokens=6)
    assert h2.cached_tokens >= (len(p) // procs.BLOCK) * procs.BLOCK
    assert decode(stack.decode_stub(), h2, max_tokens=6).tokens == reference(stack.ref, nxt, 6)


def test_a_tampered_tail_of_a_next_turn_is_recomputed_never_served(stack: Stack) -> None:
    """A session's next turn pulls only the tokens after the prefix decode's own
    G1 holds: that tail file is verified like a whole one, and a tampered one
    ends in a rebuild (the pinned prefix given back), never in served KV."""
    p = prompt(63, 40)
    pre = stack.prefill_stub()
    first = decode(stack.decode_stub(), prefill(pre, p, max_tokens=8), max_tokens=8)
    assert first.tokens == reference(stack.ref, p, 8)
    nxt = p + first.tokens + prompt(64, 20)
    want = reference(stack.ref, nxt, 8)
    held = min((len(p) + len(first.tokens) - 1) // procs.BLOCK,
               (len(nxt) - 1) // procs.BLOCK) * procs.BLOCK
    h = prefill(pre, nxt, max_tokens=8)
    (chunk,) = list(pre.PullKV(prefill_pb2.PullKVRequest(
        request_id=h.ctx.request_id, use_shm=True, start_token=held), timeout=TIMEOUT))
    assert chunk.start_token == held and chunk.token_count == len(nxt) - held
    with open(SHM / chunk.shm_name, "r+b") as f:
        f.seek(chunk.size // 2)
        f.write(b"\x7f" * 64)
    failures = _metric(stack.decode, "kvserve_decode_decode_kv_integrity_failures_total")
    assert decode(stack.decode_stub(), h, max_tokens=8).tokens == want
    assert _metric(stack.decode, "kvserve_decode_decode_kv_integrity_failures_total") == (
        failures + 1)
    # The prefix pins went back: the same turn again pulls the same tail, cleanly.
    h = prefill(pre, nxt, max_tokens=8)
    g1 = _metric(stack.decode, "kvserve_decode_decode_g1_prefix_tokens_total")
    assert decode(stack.decode_stub(), h, max_tokens=8).tokens == want
    assert _metric(stack.decode, "kvserve_decode_decode_g1_prefix_tokens_total") >= g1 + held


def _handoff(stack: Stack) -> dict[str, float]:
    return {k: _metric(stack.prefill, f"kvserve_prefill_prefill_handoff_{k}_total")
            for k in ("bytes", "materialized", "demoted")}


def test_a_next_turn_copies_only_its_tail_out_of_the_prefill_engine(stack: Stack) -> None:
    """The prompt stays resident in prefill until decode pulls: turn one's pull
    copies its whole prompt out, turn two's only the tokens after the prefix
    decode's own G1 holds (the old hand-off copied every prompt out whole)."""
    per_token = stack.ref.layout.block_nbytes // procs.BLOCK
    p = prompt(65, 45)
    pre = stack.prefill_stub()
    before = _handoff(stack)
    first = decode(stack.decode_stub(), prefill(pre, p, max_tokens=8), max_tokens=8)
    assert first.tokens == reference(stack.ref, p, 8)
    mid = _handoff(stack)
    assert mid["bytes"] - before["bytes"] == len(p) * per_token
    nxt = p + first.tokens + prompt(66, 30)
    held = min((len(p) + len(first.tokens) - 1) // procs.BLOCK,
               (len(nxt) - 1) // procs.BLOCK) * procs.BLOCK
    assert decode(stack.decode_stub(), prefill(pre, nxt, max_tokens=8),
                  max_tokens=8).tokens == reference(stack.ref, nxt, 8)
    after = _handoff(stack)
    assert after["bytes"] - mid["bytes"] == (len(nxt) - held) * per_token
    assert after["materialized"] - before["materialized"] == 2
    assert after["demoted"] == before["demoted"]


def test_a_prompt_not_pulled_within_resident_s_is_still_decoded_exactly(stack: Stack) -> None:
    """Decode comes after ``resident_s`` and after another prompt's step: the
    prompt was copied out whole in that step, and its pull serves that copy."""
    p = prompt(67, 50)
    pre = stack.prefill_stub()
    before = _handoff(stack)
    h = prefill(pre, p, max_tokens=8)
    time.sleep(0.7)                                   # past the default 0.5 s
    other = prompt(68, 20)
    ho = prefill(pre, other, max_tokens=4)            # its step demotes the first
    assert decode(stack.decode_stub(), h, max_tokens=8).tokens == reference(stack.ref, p, 8)
    assert decode(stack.decode_stub(), ho, max_tokens=4).tokens == reference(stack.ref, other, 4)
    after = _handoff(stack)
    assert after["demoted"] - before["demoted"] == 1
    assert after["materialized"] - before["materialized"] == 1


@pytest.fixture()
def forgetful_prefill(stack: Stack) -> Iterator[procs.Proc]:
    """A prefill that drops KV nobody pulled within 1 s (the old 30-s TTL, shortened)."""
    p = procs.engine_service("prefill", stack.config, stack.redis_url, stack.log_dir,
                             store_address=stack.store.address,
                             extra=("--buffer-ttl", "1", "--no-local-prefix-cache"))
    procs.start_all(p)
    try:
        yield p
    finally:
        p.stop()


def test_a_late_decode_still_completes_exactly(stack: Stack,
                                               forgetful_prefill: procs.Proc) -> None:
    """Decode arriving after the KV was dropped, or with a handle whose time
    has passed, rebuilds it and answers exactly as if it had been on time."""
    p = prompt(63, 50)
    h = prefill(stack.prefill_stub(forgetful_prefill.address), p, max_tokens=7)
    time.sleep(2.5)                                # past the bound; swept every second
    gone = "kvserve_decode_decode_rebuilds_total{kind=gone}"
    before = _metric(stack.decode, gone)
    assert decode(stack.decode_stub(), h, max_tokens=7).tokens == reference(stack.ref, p, 7)
    assert _metric(stack.decode, gone) == before + 1

    q = prompt(64, 40)
    stale = prefill_pb2.KVHandle()
    stale.CopyFrom(prefill(stack.prefill_stub(), q, max_tokens=7))
    stale.expires_at = time.time() - 60            # a handle from before, past its time
    stale_key = "kvserve_decode_decode_rebuilds_total{kind=stale_handle}"
    before = _metric(stack.decode, stale_key)
    assert decode(stack.decode_stub(), stale, max_tokens=7).tokens == reference(stack.ref, q, 7)
    assert _metric(stack.decode, stale_key) == before + 1


@pytest.fixture()
def one_slot_decode(stack: Stack) -> Iterator[procs.Proc]:
    p = procs.engine_service("decode", stack.config, stack.redis_url, stack.log_dir,
                             store_address=stack.store.address,
                             extra=("--max-seqs", "1", "--max-waiting", "0"))
    procs.start_all(p)
    try:
        yield p
    finally:
        p.stop()


def test_a_full_decode_queue_refuses_before_any_work(stack: Stack,
                                                     one_slot_decode: procs.Proc) -> None:
    dec = stack.decode_stub(one_slot_decode.address)
    pre = stack.prefill_stub()
    busy = dec.Decode(decode_pb2.DecodeRequest(handle=prefill(pre, prompt(65, 20)),
                                               sampling=sampling(900, ignore_eos=True)),
                      timeout=TIMEOUT)
    next(busy)                                     # taken: it holds the only slot
    q = prompt(66, 30)
    h = prefill(pre, q, max_tokens=5)
    with pytest.raises(grpc.RpcError) as info:
        decode(dec, h, max_tokens=5)
    err = info.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue full" in err.details()
    retry = dict(err.trailing_metadata() or ())["retry-after-ms"]
    assert int(retry) >= 1
    assert one_slot_decode.metrics()["kvserve_decode_decode_busy_rejections_total"] == 1
    # Refused before any work: its KV is still where prefill left it.
    kv = list(pre.PullKV(prefill_pb2.PullKVRequest(request_id=h.ctx.request_id),
                         timeout=TIMEOUT))
    assert sum(c.token_count for c in kv) == len(q)
    busy.cancel()
    deadline = time.monotonic() + 10
    while True:                                    # the slot frees once the cancel lands
        try:
            out = decode(dec, h, max_tokens=5)
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert time.monotonic() < deadline, "the cancelled sequence kept its slot"
            time.sleep(0.05)
    assert out.tokens == reference(stack.ref, q, 5)


def test_no_file_in_shared_memory_is_readable_by_another_user(stack: Stack) -> None:
    """After the runs above: nothing of ours in /dev/shm another uid could read,
    and no hand-off file left behind once its request was served."""
    h = prefill(stack.prefill_stub(), prompt(67, 33), max_tokens=3)
    decode(stack.decode_stub(), h, max_tokens=3)
    assert private_tree_problems(SHM, skip=LEGACY) == []
    deadline = time.monotonic() + 10
    while left := [n for n in os.listdir(SHM) if HANDOFF.match(n) and n not in stack.shm_before]:
        assert time.monotonic() < deadline, f"hand-off files left: {left}"
        time.sleep(0.05)


def test_a_resend_while_its_context_is_decoding_pulls_only_its_tail(stack: Stack) -> None:
    """An agent resends the same context while the first copy is still being
    decoded: decode's G1 has the running sequence's prompt blocks from its
    adopt on (not only from its end), so the resend pulls only its own tail,
    and both answers are exact."""
    g1 = "kvserve_decode_decode_g1_prefix_tokens_total"
    base = prompt(201, 70)
    p1, p2 = base + prompt(202, 7), base + prompt(203, 11)
    pre = stack.prefill_stub()
    running = stack.decode_stub().Decode(decode_pb2.DecodeRequest(
        handle=prefill(pre, p1, max_tokens=900), sampling=sampling(900, ignore_eos=True)),
        timeout=TIMEOUT)
    # The first event may leave before the KV is here (early first token); the
    # second is a decoded one: p1 is adopted, live, far from its end.
    head = [*next(running).token_ids, *next(running).token_ids]
    before = _metric(stack.decode, g1)
    try:
        out = decode(stack.decode_stub(), prefill(pre, p2, max_tokens=8), max_tokens=8)
        still_running = next(running).token_ids
    finally:
        running.cancel()
    assert still_running and out.tokens == reference(stack.ref, p2, 8)
    assert _metric(stack.decode, g1) - before == len(base) // procs.BLOCK * procs.BLOCK
    assert head == reference(stack.ref, p1, 2, ignore_eos=True)
