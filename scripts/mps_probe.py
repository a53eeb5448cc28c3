"""Does CUDA MPS work here, and does CUDA IPC work between its clients?

    python3 scripts/mps_probe.py RUN_DIR      # on the GPU machine, before the stack

The stack's question in small (scripts/gpu_serve.sh runs it before `kvserve bench stack
--gpu-share mps`): the daemon is the one `kvserve up` starts (kvserve/gpu_share.py), and
three spawned clients of it play the stack's CUDA children: one pins a host buffer with
cudaHostRegister (the kvstore's G2), one allocates a tensor and shares it through torch's
CUDA IPC (cudaIpcGetMemHandle, as service/kv_ipc.py does; prefill), and one opens it and
sums it (decode). This process opens no CUDA context. Prints one JSON line.
Exit 0: MPS and IPC work; 2: MPS works, IPC does not (decode then pulls through
shared memory); 1: MPS does not start or its clients fail (the stack falls back to
time slicing).
"""

from __future__ import annotations

import json
import os
import queue
import sys
import time
from pathlib import Path
from typing import Any

N = 1 << 22


def producer(out: Any, done: Any) -> None:
    import torch

    x = torch.arange(N, device="cuda", dtype=torch.float32)
    torch.cuda.synchronize()
    out.put(x)
    done.wait(60)       # keeps x alive until the consumer has read it


def holder(res: Any, done: Any) -> None:
    import ctypes

    import torch

    buf = ctypes.create_string_buffer(64 << 20)
    err = torch.cuda.cudart().cudaHostRegister(ctypes.addressof(buf), len(buf), 1)
    res.put(("host_register", int(err)))
    done.wait(60)


def consumer(inq: Any, res: Any) -> None:
    import torch

    try:
        torch.zeros(1, device="cuda")
        res.put(("client", os.getpid()))
        x = inq.get(timeout=60)
        res.put(("sum", float(x.sum(dtype=torch.float64).item())))
    except Exception as exc:    # the report names what failed
        res.put(("error", f"{type(exc).__name__}: {exc}"))


def main(run_dir: Path) -> int:
    import torch.multiprocessing as mp

    from common.config import EngineSection
    from kvserve.gpu_share import start_gpu_share

    # No CUDA call in this process: every context of the probe is a client of the daemon.
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    t0 = time.monotonic()
    try:
        share = start_gpu_share(EngineSection(gpu_share="mps"), run_dir)
    except Exception as exc:
        print(json.dumps({"mps": False, "why": str(exc)}))
        return 1
    report: dict[str, object] = {"mps": True, "daemon_start_s": round(time.monotonic() - t0, 2)}
    try:
        os.environ.update(share.env("prefill"))     # the spawned clients inherit it
        ctx = mp.get_context("spawn")
        q, res, done = ctx.Queue(), ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=holder, args=(res, done)),
                 ctx.Process(target=producer, args=(q, done)),
                 ctx.Process(target=consumer, args=(q, res))]
        for p in procs:
            p.start()
        got: dict[str, object] = {}
        deadline = time.monotonic() + 90
        while "sum" not in got and "error" not in got and time.monotonic() < deadline:
            try:
                k, v = res.get(timeout=1)
                got[k] = v
            except queue.Empty:
                if not all(p.is_alive() for p in procs):
                    got.setdefault("error", "a client exited: "
                                   + ", ".join(str(p.exitcode) for p in procs))
        while "host_register" not in got and time.monotonic() < deadline:
            try:
                k, v = res.get(timeout=2)
                got[k] = v
            except queue.Empty:
                break
        report["daemon"] = share.describe()     # while two clients still hold contexts
        done.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        want = float(N * (N - 1) // 2)
        report["ipc"] = got.get("sum") == want
        report["detail"] = got
        report["probe_s"] = round(time.monotonic() - t0, 2)
    finally:
        share.stop()
    print(json.dumps(report))
    return 0 if report["ipc"] else (2 if "client" in got else 1)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvserve-mps-probe")))
