"""Programmatic dependent launch (PDL) for the decode graph's Triton kernels.

A decode step is some 330-360 dependent kernels in one CUDA graph (llama-8b);
between two of them the GPU drained the first and only then launched the
next: 150 us of gaps in a 4.5 ms step at batch 1 on the H200, besides each
kernel's own start. With PDL (Hopper) a kernel launched with ``launch_pdl`` may
start while its predecessor runs: its programs begin, then wait in
``griddepcontrol.wait`` until the predecessor has finished and its writes are
visible, before touching any memory. Each kernel lets its successor start as
soon as all of its own programs are past that wait.

No number changes: the arithmetic is the kernels' own, only when their
programs start does. Kernels take ``PDL`` (a constexpr; False compiles to the
code without it) and launch with ``opts()``, which only the decode runner's
graph capture turns on (``dependent_launches``); prefill and eager calls
launch as before. Kernels that are not Triton's (cuBLAS, torch's) launch
plainly; a PDL kernel after one waits for it in full, as before.

Only imported with Triton (CUDA, or ``TRITON_INTERPRET=1`` where PDL is off).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except ImportError:               # an older Triton: PDL stays off
    HAVE_GDC = False

    @triton.jit
    def gdc_wait():  # type: ignore[no-redef]
        pass

    @triton.jit
    def gdc_launch_dependents():  # type: ignore[no-redef]
        pass


# decode graphs use PDL where the GPU and Triton allow (KVSERVE_PDL=0 turns it off)
WANTED = os.environ.get("KVSERVE_PDL", "1") != "0"

_active = False                   # inside a decode graph's capture
_pdl = False                      # ... with dependent launches


def supported() -> bool:
    """PDL needs Hopper (sm_90) or later and a Triton that emits griddepcontrol."""
    if not HAVE_GDC or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    import torch
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def active() -> bool:
    """Inside a decode graph's capture (``dependent_launches``)."""
    return _active


def opts() -> dict[str, object]:
    """Keyword arguments of a launch of a kernel that takes ``PDL``: the constexpr
    and Triton's ``launch_pdl``; none (the kernel's plain build) when inactive."""
    return {"PDL": True, "launch_pdl": True} if _pdl else {}


@contextmanager
def dependent_launches(on: bool) -> Iterator[None]:
    """A decode graph's capture: kernels launched inside use PDL when ``on`` (and
    the GPU and Triton support it)."""
    global _active, _pdl
    before = _active, _pdl
    _active, _pdl = True, on and supported()
    try:
        yield
    finally:
        _active, _pdl = before


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait for the kernel before (its writes visible), then let the next start."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()

