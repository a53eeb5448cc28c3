"""A process that was told to stop exits, whatever its drain is stuck on.

After SIGTERM every server drains: health NOT_SERVING, leave the registry,
finish in-flight calls, close its engine thread and executors. Some of those
steps block the event loop or a thread the interpreter waits for at exit (an
engine job that never returns, a default-executor thread in a blocking call,
a Redis that died with a kill -9'ed launcher). An ``asyncio.wait_for`` cannot
interrupt a blocked loop, so the bound is a daemon timer thread armed when the
drain starts: past the grace plus some slack it logs once and ``os._exit``s.
Only the exit status says it was cut short.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

EXIT_SLACK_S = 5.0               # beyond the drain's own grace
CUT_SHORT_STATUS = 3             # the exit status of a drain that had to be cut


def arm(what: str, grace_s: float, *, slack_s: float = EXIT_SLACK_S) -> threading.Timer:
    """Start the bound on ``what``'s shutdown; the caller need not cancel it
    (a process that exits first takes the daemon thread with it)."""
    limit = max(0.0, grace_s) + slack_s

    def cut() -> None:
        msg = f"{what}: shutdown did not finish within {limit:.1f}s of the stop; exiting"
        log.warning(msg)
        print(msg, file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(CUT_SHORT_STATUS)

    timer = threading.Timer(limit, cut)
    timer.daemon = True
    timer.name = f"exit-watchdog-{what}"
    timer.start()
    return timer


__all__ = ["CUT_SHORT_STATUS", "EXIT_SLACK_S", "arm"]
