"""A fuse decision for a training graph judges the step, not the forward alone (tuning/decide.py).

A post-norm forward fused in training measured faster alone, and the training step with it 7% slower than
Inductor's on the H200 (RMSNorm, K = N = 256, M = 262144): what the fused forward saves and the backward it
implies cost more than the forward won. These tests pin the rule on stand-in measurements (CPU); the H200 run
of the real case is in benchmarks/results/.
"""

from __future__ import annotations

import pytest
import torch

from fusenorm_inductor import config
from fusenorm_inductor.tuning import decide, measure
from fusenorm_inductor.tuning import mm_norm as mm_norm_tuning

CUDA = torch.device("cuda")
FORWARD = {"config": ["gl_pp", 128, 256, 64, 3, 8], "t_fused_ms": 0.40, "t_unfused_ms": 0.60, "candidates": {}}


@pytest.fixture(autouse=True)
def _measuring(monkeypatch, tmp_path):
    measure.clear_memory()
    monkeypatch.setattr(measure, "can_measure", lambda device: True)
    monkeypatch.setattr(measure, "_device_tag", lambda device: f"fake {device}")
    with config.patch({"tuning.cache_dir": str(tmp_path), "tuning.host_weight": 0.0}):
        yield
    measure.clear_memory()


def _decide(step: dict | None, key=("post_norm", CUDA, "k")):
    """The decision on FORWARD (a clear forward win: 0.40 vs 0.60 ms), with ``step`` as the training step's
    measurement (None: an inference graph, no step is asked for)."""
    asked = []

    def step_fn():
        asked.append(True)
        return step

    choice = decide._choice(key, CUDA, lambda: dict(FORWARD), lambda: "first",
                            step_fn=None if step is None else step_fn)
    return choice, asked


def test_inference_judges_the_forward():
    choice, asked = _decide(None)
    assert choice.fuse and not asked and "training step" not in choice.reason


def test_a_step_that_loses_is_left_unfused():
    """The forward wins by a third, the step loses 7%: left unfused, and the reason gives both."""
    choice, asked = _decide({"t_fused_step_ms": 2.14, "t_unfused_step_ms": 2.0})
    assert asked and not choice.fuse, choice
    assert "would not win the training step" in choice.reason and "2.14 ms fused" in choice.reason
    assert "the forward alone: fused (measured 0.4 ms" in choice.reason, choice.reason


def test_a_step_that_wins_by_the_margin_is_fused():
    choice, asked = _decide({"t_fused_step_ms": 1.5, "t_unfused_step_ms": 2.0})
    assert asked and choice.fuse and "measured the training step: 1.5 ms" in choice.reason, choice


def test_the_step_is_judged_by_its_own_margin():
    """The forward (a Gluon label) needs the Gluon margin; the step, timed both ways in alternating rounds,
    ``tuning.margin_step``: 8% is enough at 5%, not at 10%."""
    key = ("post_norm", CUDA, "gl")
    entry = {**FORWARD, "config": ["gl_pp", 64, 256, 64, 4, 4]}
    step = {"t_fused_step_ms": 1.84, "t_unfused_step_ms": 2.0}
    for margin, fuse in ((0.05, True), (0.10, False)):
        measure.clear_memory()
        with config.patch({"tuning.margin_step": margin}):
            choice = decide._choice(key + (margin,), CUDA, lambda: dict(entry), lambda: "first",
                                    step_fn=lambda: dict(step))
        assert choice.fuse is fuse and choice.config.startswith("gl_"), choice


def test_a_step_within_the_margin_is_left_unfused():
    choice, _ = _decide({"t_fused_step_ms": 1.95, "t_unfused_step_ms": 2.0})
    assert not choice.fuse


def test_a_step_that_cannot_be_measured_is_left_unfused():
    choice, asked = _decide({})
    assert asked and not choice.fuse and "could not be measured" in choice.reason


def test_the_step_is_measured_once_and_kept():
    key = ("post_norm", CUDA, "kept")
    first, asked = _decide({"t_fused_step_ms": 1.5, "t_unfused_step_ms": 2.0}, key)
    again, asked_again = _decide({"t_fused_step_ms": 9.0, "t_unfused_step_ms": 2.0}, key)
    assert asked and not asked_again and again.fuse == first.fuse is True
    assert measure.lookup(key)["t_fused_step_ms"] == 1.5


def test_forward_choice_asks_for_the_step_only_in_training(monkeypatch):
    """The pattern's entry point: ``training=True`` routes the step measurement in, inference leaves it out."""
    calls = []
    monkeypatch.setattr(mm_norm_tuning, "measure_forward", lambda *a: dict(FORWARD))
    monkeypatch.setattr(mm_norm_tuning, "measure_step",
                        lambda *a: calls.append(a) or {"t_fused_step_ms": 3.0, "t_unfused_step_ms": 2.0})
    monkeypatch.setattr(mm_norm_tuning, "gluon_unsupported", lambda *a: None)
    a = torch.empty(512, 256, dtype=torch.bfloat16, device="meta")
    b = torch.empty(256, 256, dtype=torch.bfloat16, device="meta")
    w = torch.empty(256, dtype=torch.bfloat16, device="meta")
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: CUDA))
    args = (a, b, None, None, w, None, 1e-6, True, torch.bfloat16, True)
    assert mm_norm_tuning.forward_choice(*args).fuse and not calls
    assert not mm_norm_tuning.forward_choice(*args, training=True).fuse and len(calls) == 1


@pytest.mark.parametrize("rms", [False, True])
def test_post_norm_step_measurement_plumbing(cpu_step_timer, rms):
    """``measure_step`` with the GPU timer replaced (``cpu_step_timer``): the fused op (its own autograd, the
    norm's backward decomposed) and Inductor's unfused linear + norm compile for the same inputs and agree on
    the output and every gradient (a, b, bias, residual, the norm's weight and bias)."""
    torch.manual_seed(20)
    a, b, bias, res = torch.randn(67, 24), torch.randn(24, 40) / 5, torch.randn(40), torch.randn(67, 40)
    w, nb = torch.randn(40), (None if rms else torch.randn(40))
    got = mm_norm_tuning.measure_step(a, b, bias, res, w, nb, 1e-5, rms, None, True)
    assert got == {"t_fused_step_ms": 1.0, "t_unfused_step_ms": 2.0} and cpu_step_timer == ["linear + norm"]
