"""How the engine processes of one ``kvserve up`` share one GPU (``[engine] gpu_share``).

"time" (the default) leaves it to the driver: each process has its own context and the
GPU runs one context at a time, so prefill's and decode's kernels take turns (issue 18
run 17: prefill's steps at 0.28x their speed alone, decode's forward 1.8x its roofline).
"mps" starts a CUDA Multi-Process Service control daemon for this stack alone: its pipe
and log directories are private (0700) folders of the run directory, only the children
that open a CUDA context get the variables that point at them (the engines, and the
kvstore, which pins G2 with cudaHostRegister: so no context of the stack is left to
time-slice against the MPS server's), and the daemon is told to quit when the stack
stops or fails to start. Nothing about the GPU itself changes (no compute-mode switch,
no reset): a process without the variables keeps a context of its own as before.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.config import EngineSection
from kvserve.children import Child
from kvserve.cli import UsageError

MPS_CONTROL = "nvidia-cuda-mps-control"
ENGINE_ROLES = ("prefill", "decode")
CUDA_ROLES = ("kvstore", *ENGINE_ROLES)     # the children that open a CUDA context
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
SM_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
# The daemon's sockets live in the pipe directory and a Unix socket's path is at most
# 107 bytes; leave room for the daemon's own file names.
_PIPE_PATH_MAX = 80


class GpuShareError(UsageError):
    """The MPS daemon could not be started (the message says why, in one line)."""


class TimeSlicing:
    """The driver's default: the engines get no variables and nothing is started."""

    mode = "time"

    def env(self, role: str) -> dict[str, str]:
        return {}

    def describe(self) -> str:
        return "time slicing (one process's kernels at a time)"

    def stop(self) -> None:
        return None


@dataclass(slots=True)
class MpsDaemon:
    """A running MPS control daemon that this stack started and will stop."""

    control: str                                # the nvidia-cuda-mps-control binary
    pipe_dir: Path
    log_dir: Path
    sm_percent: Mapping[str, int] = field(default_factory=dict)     # role -> 1..100
    stopped: bool = False
    mode = "mps"

    def base_env(self) -> dict[str, str]:
        return {PIPE_ENV: str(self.pipe_dir), LOG_ENV: str(self.log_dir)}

    def env(self, role: str) -> dict[str, str]:
        """What a child of ``role`` adds to its environment: the children with a
        CUDA context join the daemon, the engines with their SM cap (if any); the
        router stays off it."""
        role = role.split("-", 1)[0]
        if role not in CUDA_ROLES:
            return {}
        pct = self.sm_percent.get(role, 0)
        return self.base_env() | ({SM_ENV: str(pct)} if pct else {})

    def command(self, text: str, timeout_s: float = 10.0) -> subprocess.CompletedProcess[str]:
        """One control command (``get_server_list``, ``quit``) to this daemon."""
        return subprocess.run([self.control], input=text + "\n", text=True,
                              capture_output=True, timeout=timeout_s, check=False,
                              env=os.environ | self.base_env())

    def describe(self) -> str:
        """Which MPS servers run and which processes are their clients, as the
        daemon says (so a log shows the engines really joined it)."""
        try:
            servers = self.command("get_server_list").stdout.split()
            clients = {s: self.command(f"get_client_list {s}").stdout.split() for s in servers}
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"MPS (daemon not answering: {exc}); logs {self.log_dir}"
        who = "; ".join(f"server {s}: clients {' '.join(c) or 'none'}"
                        for s, c in clients.items()) or "no server yet"
        return f"MPS ({who}); logs {self.log_dir}"

    def stop(self) -> None:
        """Tell the daemon to quit (it stops its server first); idempotent."""
        if self.stopped:
            return
        self.stopped = True
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self.command("quit")
        deadline = time.monotonic() + 10.0
        while (self.pipe_dir / "control").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        shutil.rmtree(self.pipe_dir, ignore_errors=True)


GpuShare = TimeSlicing | MpsDaemon


def pipe_dir_for(run_dir: Path) -> Path:
    """A fresh private (0700) pipe directory: in the run directory, or under the
    system's temporary folder when that path is too long for the daemon's sockets."""
    base = run_dir.resolve()
    if len(str(base)) + len("/mps-pipe-XXXXXXXX") > _PIPE_PATH_MAX:
        base = Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="mps-pipe-", dir=base))     # mkdtemp: 0700


def start_gpu_share(engine: EngineSection, run_dir: Path, children: Sequence[Child] = (),
                    control: str = MPS_CONTROL) -> GpuShare:
    """Time slicing, or a private MPS daemon started and answering; each of
    ``children`` gets the variables of its role (``Child.env``)."""
    share = _start(engine, run_dir, control)
    for c in children:
        c.env = share.env(c.role or c.name)
    return share


def _start(engine: EngineSection, run_dir: Path, control: str) -> GpuShare:
    if engine.gpu_share != "mps":
        return TimeSlicing()
    binary = shutil.which(control)
    if binary is None:
        raise GpuShareError(f'[engine] gpu_share = "mps" needs {control} on the PATH (it '
                            'ships with the NVIDIA driver); without it use gpu_share = "time"')
    log_dir = run_dir / "mps-log"
    log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    daemon = MpsDaemon(binary, pipe_dir_for(run_dir), log_dir,
                       {"prefill": engine.prefill_sm_percent,
                        "decode": engine.decode_sm_percent})
    # The daemon forks away: its output goes to a file, never to a pipe we would wait on.
    out = log_dir / "start.log"
    with open(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        code = subprocess.run([binary, "-d"], stdin=subprocess.DEVNULL, stdout=f,
                              stderr=subprocess.STDOUT, env=os.environ | daemon.base_env(),
                              timeout=30, check=False).returncode
    if code != 0:
        daemon.stop()
        raise GpuShareError(f"{binary} -d exited with status {code}: "
                            f"{out.read_text(errors='replace').strip()[-300:]} (logs {log_dir})")
    _wait_answering(daemon, timeout_s=10.0)
    return daemon


def _wait_answering(daemon: MpsDaemon, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        res = daemon.command("get_server_list")
        if res.returncode == 0:
            return
        if time.monotonic() > deadline:
            daemon.stop()
            raise GpuShareError(f"the MPS daemon does not answer after {timeout_s:.0f} s: "
                                f"{(res.stdout + res.stderr).strip()[-300:]} (logs "
                                f"{daemon.log_dir})")
        time.sleep(0.2)
