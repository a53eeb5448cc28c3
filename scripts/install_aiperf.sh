#!/usr/bin/env bash
# AIPerf (PyPI `aiperf`) in a virtualenv of its own, so its pins never touch kvserve's.
#
#   scripts/install_aiperf.sh            # -> $AIPERF_HOME (default ~/.cache/kvserve/aiperf-<ver>)
#   AIPERF_VERSION=0.13.0 scripts/install_aiperf.sh
#
# Prints the path of the `aiperf` executable on its last line. Idempotent and quick once
# installed (the folder is kept between runs: CI and developers reuse it). The folder lives
# outside the work tree (or in the ignored .cache/ of it when AIPERF_HOME points there).
set -euo pipefail
version="${AIPERF_VERSION:-0.13.0}"
home="${AIPERF_HOME:-${KVSERVE_CACHE:-$HOME/.cache/kvserve}/aiperf-$version}"
python="${PYTHON:-python3}"
stamp="$home/.installed-$version"
if [[ -x "$home/bin/aiperf" && -f "$stamp" ]]; then
  echo "$home/bin/aiperf"
  exit 0
fi
mkdir -p "$(dirname "$home")"
umask 077
# One installer at a time per folder: a second caller (a test that started the install in
# the background, then needs AIPerf) waits for the first and finds it installed.
exec 9>"$home.lock"
flock 9
if [[ -x "$home/bin/aiperf" && -f "$stamp" ]]; then
  echo "$home/bin/aiperf"
  exit 0
fi
rm -rf "$home"
"$python" -m venv "$home"
# No bytecode compiled up front (1.2 GB of packages; a run compiles what it imports) and
# the venv's own pip as it comes: 45 s instead of 56 s here.
"$home/bin/pip" install --quiet --disable-pip-version-check --no-compile "aiperf==$version" >&2
"$home/bin/aiperf" --version >&2 || "$home/bin/aiperf" --help >/dev/null
touch "$stamp"
echo "$home/bin/aiperf"
