"""The prefill scheduler's bookkeeping (prefill_svc/scheduler.py): budgets,
ordering with aging, admission limits, and refusals with a retry estimate."""

from __future__ import annotations

import pytest

from common.config import ConfigError, PrefillSection
from prefill_svc.scheduler import Entry, Scheduler


def sched(**kw: object) -> Scheduler:
    return Scheduler(PrefillSection(**kw), tokens_per_s=1000.0)  # type: ignore[arg-type]


def ready(s: Scheduler, rid: str, arrival: float, remaining: int, blocks: int = 1) -> Entry:
    e = Entry(rid, remaining, arrival, remaining, blocks)
    s.add(e)
    s.mark_ready(e, remaining, blocks)
    return e


def test_fcfs_fills_the_budget_in_arrival_order_and_chunks_the_long_one() -> None:
    s = sched(policy="fcfs", step_tokens=512)
    ready(s, "long", 0.0, 6000)
    ready(s, "short", 1.0, 40)
    p = s.plan(free_blocks=1000, now=1.0)
    assert [e.request_id for e in p.admit] == ["long"] and p.budgets == {"long": 512}


def test_src_lets_a_warm_turn_pass_a_cold_prompt() -> None:
    s = sched(policy="src", step_tokens=512, max_delay_s=4.0)
    long = ready(s, "long", 0.0, 6000)
    s.admitted(long, 6000)
    ready(s, "cold", 0.5, 480)
    ready(s, "warm", 1.0, 20)
    p = s.plan(free_blocks=1000, now=1.0)
    assert [e.request_id for e in p.admit] == ["warm", "cold"]
    assert p.budgets == {"warm": 20, "cold": 480, "long": 12}


def test_an_aged_prompt_takes_half_of_each_step_first_and_never_the_whole_step() -> None:
    """aging = "share": a cold long context that has waited max_delay_s advances
    at least at half speed, and agent turns arriving behind it still go in the
    same step; "strict" (the default) gives the aged the whole step."""
    s = sched(policy="src", step_tokens=512, max_delay_s=4.0, aging="share")
    long = ready(s, "long", 0.0, 6000)
    s.admitted(long, 6000)
    ready(s, "turn", 5.0, 60)
    ready(s, "cold", 5.5, 480)
    p = s.plan(free_blocks=1000, now=6.0)
    assert p.budgets == {"long": 256, "turn": 60, "cold": 196}
    assert next(iter(p.budgets)) == "long"              # its share is taken first
    # Alone, it still gets the whole step (a solo one: nothing waits behind it).
    s2 = sched(policy="src", step_tokens=512, max_delay_s=4.0, aging="share")
    solo = ready(s2, "long", 0.0, 6000)
    s2.admitted(solo, 6000)
    assert s2.plan(free_blocks=1000, now=6.0).budgets == {"long": 2048}
    # Several aged ones share the half in arrival order; the policy takes the rest.
    s3 = sched(policy="src", step_tokens=512, max_delay_s=4.0, aging="share")
    ready(s3, "old2", 1.0, 200)
    ready(s3, "old1", 0.0, 200)
    ready(s3, "new", 9.0, 100)
    p3 = s3.plan(free_blocks=1000, now=10.0)
    assert p3.budgets == {"old1": 200, "old2": 200, "new": 100}
    assert [e.request_id for e in p3.admit] == ["old1", "old2", "new"]
    # Resends held for the running long prompt lend it their shares: with two
    # aged ones waiting on it, it takes 3/4 of the step first.
    s5 = sched(policy="src", step_tokens=512, max_delay_s=4.0, aging="share")
    ctx = [bytes([i]) * 16 for i in range(80)]
    first = _keyed(s5, "first", 0.0, ctx)
    s5.admitted(first, 64 * 80)
    _keyed(s5, "resend1", 1.0, [*ctx, b"a" * 16])
    _keyed(s5, "resend2", 2.0, [*ctx, b"b" * 16])
    ready(s5, "turn", 9.0, 300)
    assert s5.plan(free_blocks=1000, now=10.0).budgets == {"first": 384, "turn": 128}
    # aging = "strict" (the default): the aged take the whole step, oldest first.
    s6 = sched(policy="src", step_tokens=512, max_delay_s=4.0)
    held = ready(s6, "long", 0.0, 6000)
    s6.admitted(held, 6000)
    ready(s6, "turn", 5.0, 60)
    assert s6.plan(free_blocks=1000, now=6.0).budgets == {"long": 512}
    # An aged one the pool cannot hold yet stops admissions behind it.
    s4 = sched(policy="src", step_tokens=512, max_delay_s=4.0, aging="share")
    ready(s4, "big", 0.0, 3000, blocks=50)
    ready(s4, "small", 9.0, 10, blocks=1)
    assert s4.plan(free_blocks=10, now=10.0).admit == ()


def test_admission_limits_running_prompts_and_waits_for_the_pool() -> None:
    s = sched(policy="fcfs", step_tokens=10_000, max_running=2)
    for i in range(4):
        ready(s, f"r{i}", float(i), 100, blocks=5)
    p = s.plan(free_blocks=1000, now=9.0)
    assert [e.request_id for e in p.admit] == ["r0", "r1"]
    # The first that does not fit stops admissions: no smaller one overtakes it.
    s2 = sched(policy="fcfs", step_tokens=10_000)
    ready(s2, "big", 0.0, 100, blocks=50)
    ready(s2, "small", 1.0, 100, blocks=1)
    assert s2.plan(free_blocks=10, now=2.0).admit == ()
    # Only ready requests are admitted (the others are still fetching).
    s3 = sched()
    s3.add(Entry("fetching", 100, 0.0, 100, 2))
    assert not s3.has_work and s3.plan(free_blocks=10, now=1.0).budgets == {}


def test_cancelled_running_prompts_are_stopped_not_stepped() -> None:
    s = sched(step_tokens=100)
    a = ready(s, "a", 0.0, 500)
    s.admitted(a, 500)
    a.cancelled = True
    p = s.plan(free_blocks=100, now=1.0)
    assert p.stop == (a,) and p.budgets == {}


def test_full_queue_refuses_with_a_retry_estimate() -> None:
    s = sched(max_waiting=2, max_waiting_tokens=1000)
    assert s.check_count() is None and s.check_tokens(5000) is None   # empty: any prompt
    ready(s, "a", 0.0, 600)
    busy = s.check_tokens(600)
    assert busy is not None and "max_waiting_tokens 1000" in busy.reason
    assert busy.retry_after_ms == 200          # 200 excess tokens at 1000 tokens/s
    ready(s, "b", 0.0, 100)
    busy = s.check_count()
    assert busy is not None and "2 requests waiting" in busy.reason and busy.retry_after_ms >= 10
    assert s.queue == 2 and s.tokens_in_flight == 700


def test_prefill_section_validates() -> None:
    with pytest.raises(ConfigError, match=r"one of \['fcfs', 'src'\]"):
        PrefillSection(policy="lifo")
    with pytest.raises(ConfigError, match="step_tokens"):
        PrefillSection(step_tokens=0)
    with pytest.raises(ConfigError, match=r"aging must be one of \['share', 'strict'\]"):
        PrefillSection(aging="lifo")


def _keyed(s: Scheduler, rid: str, arrival: float, keys: list[bytes], cached: int = 0) -> Entry:
    L = 64 * len(keys)
    e = Entry(rid, L, arrival, L - cached, len(keys), keys=tuple(keys), block_tokens=64)
    s.add(e)
    s.mark_ready(e, L - cached, len(keys))
    return e


def test_a_resent_context_waits_for_the_running_prompt_then_goes() -> None:
    """An agent resends a long context while its previous turn is in prefill:
    the resend waits (admitted afterwards as a G1 hit) instead of computing the
    same blocks beside it; a prompt sharing only a short prefix is not held."""
    s = sched(policy="src", step_tokens=16384)
    ctx = [bytes([i]) * 16 for i in range(80)]
    first = _keyed(s, "turn1", 0.0, ctx)
    s.admitted(first, 64 * 80)
    _keyed(s, "turn2", 1.0, [*ctx, b"n" * 16])                  # the same context + new text
    other = _keyed(s, "other", 2.0, [*ctx[:2], *(bytes([200 + i]) * 16 for i in range(10))])
    p = s.plan(free_blocks=1000, now=2.0)
    assert [e.request_id for e in p.admit] == ["other"]          # two shared blocks: no hold
    s.admitted(other, other.remaining)
    s.drop(first)                                                # done: its blocks are in G1
    assert "turn2" in [e.request_id for e in s.plan(free_blocks=1000, now=3.0).admit]
    # A prefix the waiting one already has cached is no reason to wait.
    s2 = sched(policy="src", step_tokens=512)
    run = _keyed(s2, "run", 0.0, ctx)
    s2.admitted(run, 64 * 80)
    _keyed(s2, "warm", 1.0, ctx[:40], cached=64 * 40 - 1)
    assert [e.request_id for e in s2.plan(free_blocks=1000, now=1.0).admit] == ["warm"]


def test_a_prompt_alone_takes_a_solo_step_and_shares_step_tokens_once_another_comes() -> None:
    """Alone (nothing else running or waiting, even unready), a prompt takes
    solo_step_tokens at once; with anyone else around, the step is step_tokens."""
    s = sched(policy="src", step_tokens=512)
    long = ready(s, "long", 0.0, 6000)
    assert s.plan(free_blocks=1000, now=0.0).budgets == {"long": 2048}
    s.admitted(long, 6000)
    assert s.plan(free_blocks=1000, now=1.0).budgets == {"long": 2048}
    s.add(Entry("warming", 100, 1.5, 0, 0))          # queued, its restore not planned yet
    assert s.plan(free_blocks=1000, now=2.0).budgets == {"long": 512}
    s.drop(s.waiting["warming"])
    ready(s, "turn", 2.5, 60)
    assert s.plan(free_blocks=1000, now=3.0).budgets == {"turn": 60, "long": 452}
    # 0 (or anything below step_tokens): every step is step_tokens.
    for solo in (0, 256):
        s0 = sched(policy="src", step_tokens=512, solo_step_tokens=solo)
        ready(s0, "long", 0.0, 6000)
        assert s0.plan(free_blocks=1000, now=0.0).budgets == {"long": 512}
    with pytest.raises(ConfigError, match="solo_step_tokens"):
        PrefillSection(solo_step_tokens=-1)
