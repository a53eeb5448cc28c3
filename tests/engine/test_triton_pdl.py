"""Dependent launches (engine/triton_pdl.py) are confined to a decode graph's
capture and off wherever the GPU or Triton cannot do them: a plain launch is
what every other call gets. Whether PDL keeps the bits is the device's to show
(benchmarks/decode_profile.py compares logits and tokens; the GPU tests run
with it on)."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs Triton")


def test_launches_are_plain_outside_a_decode_capture() -> None:
    from engine import triton_pdl

    assert not triton_pdl.active()
    assert triton_pdl.opts() == {}


def test_a_capture_without_pdl_support_launches_plainly(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import triton_pdl

    monkeypatch.setattr(triton_pdl, "supported", lambda: False)
    with triton_pdl.dependent_launches(True):
        assert triton_pdl.active()
        assert triton_pdl.opts() == {}
    assert not triton_pdl.active()


def test_a_capture_with_pdl_passes_the_constexpr_and_the_launch_flag(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import triton_pdl

    monkeypatch.setattr(triton_pdl, "supported", lambda: True)
    on = {"PDL": True, "launch_pdl": True}
    with triton_pdl.dependent_launches(True):
        assert triton_pdl.opts() == on
        with triton_pdl.dependent_launches(False):      # a runner built with pdl=False
            assert triton_pdl.opts() == {}
        assert triton_pdl.opts() == on
    assert triton_pdl.opts() == {}


def test_the_cpu_never_asks_for_pdl() -> None:
    import torch

    from engine import triton_pdl

    if torch.cuda.is_available():
        pytest.skip("checks the CPU answer")
    assert not triton_pdl.supported()
