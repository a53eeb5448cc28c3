"""Does CUDA MPS work here, and does CUDA IPC work between its clients?

    python3 scripts/mps_probe.py RUN_DIR      # on the GPU machine, before the stack

The stack's question in small (scripts/gpu_serve.sh runs it before `kvserve bench stack
--gpu-share mps`): this process holds a context of its own off MPS, as the kvstore does
(it pins G2 with cudaHostRegister); the daemon is the one `kvserve up` starts
(kvserve/gpu_share.py); two spawned clients of it play prefill and decode: one allocates
a tensor and shares it through torch's CUDA IPC (cudaIpcGetMemHandle, as
service/kv_ipc.py does), the other opens it and sums it. Prints one JSON line.
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
    import torch
    import torch.multiprocessing as mp

    from common.config import EngineSection
    from kvserve.gpu_share import start_gpu_share

    if not torch.cuda.is_available():
        print(json.dumps({"mps": False, "why": "no CUDA device"}))
        return 1
    torch.zeros(1, device="cuda")       # an off-MPS context here, as the kvstore's
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
        procs = [ctx.Process(target=producer, args=(q, done)),
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
        report["daemon"] = share.describe()     # while both clients still hold contexts
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
