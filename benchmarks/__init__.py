"""Every ``kvserve bench …`` command, one module each, named as the command
(``kvserve bench store`` is ``benchmarks/store.py``, its flags in
``benchmarks/commands.py``), all on one harness (``benchmarks/harness.py``:
repeats, min/median/max, goals against limits measured in the same run,
``--json``, a table, ``--png``); plus the GPU kernel scripts
(``python -m benchmarks.bik``, ``python -m benchmarks.kernels``).

The top floor: a benchmark may start a whole stack through the launcher, so
it stands above everything it measures and nothing imports it."""

import common.process_env  # noqa: F401  (before any benchmark loads torch)
