"""A stopped server exits even when its drain blocks (common.exit_watchdog)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from common.exit_watchdog import CUT_SHORT_STATUS

_BLOCKED = textwrap.dedent("""
    import threading, time
    from common import exit_watchdog
    exit_watchdog.arm("test", 0.2, slack_s=0.3)
    threading.Event().wait()        # a drain stuck in a blocking call, loop and all
""")

_QUICK = textwrap.dedent("""
    from common import exit_watchdog
    exit_watchdog.arm("test", 5.0)
    print("drained")                # a drain that finishes exits normally, at once
""")


def test_a_blocked_drain_is_cut_at_grace_plus_slack() -> None:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _BLOCKED], capture_output=True, text=True,
                          timeout=30)
    took = time.monotonic() - t0
    assert proc.returncode == CUT_SHORT_STATUS
    assert "shutdown did not finish within 0.5s" in proc.stderr
    assert took < 20


def test_a_drain_that_finishes_is_not_cut() -> None:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _QUICK], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0 and proc.stdout.strip() == "drained"
    assert time.monotonic() - t0 < 5.0     # the daemon timer does not hold the exit
