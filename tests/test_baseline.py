"""The decision's unfused side as Inductor compiles it (ops/baseline.py): the subgraphs it compiles compute what
the fused ops compute, fusenorm's passes stand aside in that compile, a compile that fails falls back to the
estimate with one warning, and the decision uses the measured Inductor time and host time when it has them."""

import warnings

import pytest
import torch

from fusenorm_inductor import config, passes
from fusenorm_inductor.tuning import baseline, decide as tuning, measure
from fusenorm_inductor.ops.mm_norm import mm_norm_reference
from fusenorm_inductor.ops.norm_mm import norm_mm_reference

from .test_contract import fusenorm_ops_run


def _rand(*shape, gen):
    return torch.randn(*shape, generator=gen)


def _gemm(seed: int, m: int, k: int, n: int):
    """A generator and random [m, k] x [k, n] operands of unit-scale product."""
    gen = torch.Generator().manual_seed(seed)
    return gen, _rand(m, k, gen=gen), _rand(k, n, gen=gen) * k ** -0.5


def _assert_compiled_matches(fn, inputs, want) -> None:
    """Inductor's compile of fn computes ``want`` (a tensor, or a tuple compared item by item)."""
    got = baseline.compile_unfused(fn, inputs)(*inputs)
    got, want = (got, want) if isinstance(want, tuple) else ((got[0] if isinstance(got, (tuple, list)) else got,), (want,))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("is_rms,with_bias,with_res,affine", [(False, True, True, True), (True, False, False, True),
                                                              (False, False, True, False)],
                         ids=["ln-bias-res-affine", "rms", "ln-res-noaffine"])
def test_post_norm_subgraph_matches_reference(is_rms, with_bias, with_res, affine):
    m, k, n = 37, 24, 40
    gen, a, b = _gemm(1, m, k, n)
    bias = _rand(n, gen=gen) if with_bias else None
    res = _rand(m, n, gen=gen) if with_res else None
    w = _rand(n, gen=gen) if affine else None
    nb = _rand(n, gen=gen) if affine and not is_rms else None
    fn, inputs = baseline.post_norm_fn(a, b, bias, res, w, nb, 1e-5, is_rms, None)
    assert all(t is not None for t in inputs)
    _assert_compiled_matches(fn, inputs, mm_norm_reference(a, b, bias, res, w, nb, 1e-5, is_rms)[0])


@pytest.mark.parametrize("is_rms,with_bias,affine", [(False, True, True), (True, False, False)],
                         ids=["ln-bias-affine", "rms-noaffine"])
def test_pre_norm_subgraph_matches_reference(is_rms, with_bias, affine):
    gen, a, b = _gemm(2, 41, 40, 24)
    a, k, n = a * 3 + 1, 40, 24
    bias = _rand(n, gen=gen) if with_bias else None
    w = _rand(k, gen=gen) if affine else None
    nb = _rand(k, gen=gen) if affine and not is_rms else None
    fn, inputs = baseline.pre_norm_fn(a, b, bias, w, nb, 1e-6, is_rms, None)
    _assert_compiled_matches(fn, inputs, norm_mm_reference(a, b, bias, w, nb, 1e-6, is_rms)[0])


def test_fusenorm_passes_stand_aside_in_the_baseline_compile(monkeypatch):
    """With fusenorm's passes installed in Inductor's config (as during a fusenorm compile), the baseline's
    compile of linear -> LayerNorm never runs them (they would see its graph otherwise) and no fusenorm op
    runs in the compiled code."""
    import fusenorm_inductor.patterns as patterns

    gen = torch.Generator().manual_seed(3)
    a, b, w = _rand(33, 16, gen=gen), _rand(16, 24, gen=gen), _rand(24, gen=gen)
    fn, inputs = baseline.post_norm_fn(a, b, None, None, w, None, 1e-5, False, None)
    stages = []
    monkeypatch.setattr(patterns, "run_stage", lambda stage, graph, rep: stages.append(stage))
    passes.install()
    try:
        with config.patch({"tuning.measure": False}):
            compiled = baseline.compile_unfused(fn, inputs)
    finally:
        passes.uninstall()
    assert stages == []
    assert not baseline.in_baseline_compile()  # the flag is this compile's only
    assert fusenorm_ops_run(lambda: compiled(*inputs)) == set()


def test_a_failing_baseline_falls_back_to_the_estimate_with_one_warning():
    """On inputs it cannot time (CPU tensors: there is no CUDA device to time on) ``time_compiled`` returns None
    and warns once, naming what it could not compile; the second failure for the same reason is quiet."""
    measure.clear_memory()
    x = torch.randn(8, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert baseline.time_compiled(lambda t: t * 2, [x], "linear + norm") is None
        assert baseline.time_compiled(lambda t: t * 2, [x], "linear + norm") is None
    msgs = [str(w.message) for w in caught if "unfused linear + norm" in str(w.message)]
    assert len(msgs) == 1 and "estimates it" in msgs[0], msgs
    measure.clear_memory()


def test_time_compiled_alternates_with_the_fused_side(monkeypatch):
    """With ``against``, Inductor's code and the fused call are timed in turn, ALTERNATING_ROUNDS rounds each,
    and the result is both medians (with Inductor's host time): the order of the timings is checked, not
    only the arithmetic, so a version that timed one side after the other fails."""
    order = []
    clock = iter([5.0, 1.0, 9.0, 2.0, 6.0, 3.0])  # Inductor, fused, Inductor, fused, ...

    def fake_time(fn, give_up_ms=None):
        fn()
        return next(clock)

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(baseline, "compile_unfused", lambda fn, inputs: lambda *a: order.append("inductor"))
    monkeypatch.setattr(measure, "time_ms", fake_time)
    monkeypatch.setattr(measure, "host_us", lambda call, gpu_ms=None: 40.0)
    out = baseline.time_compiled(lambda t: t * 2, [torch.randn(4, 4)], "site", against=lambda: order.append("fused"))
    assert order == ["inductor", "fused"] * baseline.ALTERNATING_ROUNDS
    assert out == (6.0, 40.0, 2.0)
    # without it, one timing of Inductor's code and its host time, as before
    clock = iter([4.0])
    order.clear()
    assert baseline.time_compiled(lambda t: t * 2, [torch.randn(4, 4)], "site") == (4.0, 40.0)
    assert order == ["inductor"]


def _run_script(source: str, timeout: float) -> str:
    """stdout of ``source`` run by this Python in a subprocess, which must exit 0 within ``timeout`` seconds (a
    hang fails the test instead of stopping the run)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


_NESTED_STEP = """
import torch
from torch._dynamo.convert_frame import compile_lock
from fusenorm_inductor.tuning import baseline

def step():
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(3, 8, requires_grad=True)
    f = baseline.compile_unfused(lambda a, b: (torch.nn.functional.linear(a, b).relu().sum(),), [x, w],
                                 training=True)
    torch.autograd.backward(f(x, w)[0])
    mask = (x @ w.t() > 0).float()
    torch.testing.assert_close(x.grad, mask @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, mask.t() @ x, rtol=1e-5, atol=1e-5)
    return "gradients ok"

def backend(gm, example_inputs):
    print("owned", compile_lock._is_owned(), baseline.in_worker(step), compile_lock._is_owned(), flush=True)
    return gm.forward

torch.compile(lambda t: t + 1, backend=backend)(torch.randn(4))
"""


def test_a_nested_training_compile_runs_inside_an_outer_compile():
    """Inside torch.compile (dynamo holds its compile lock while a backend runs, as while fusenorm's passes
    decide) the worker compiles a training step with Inductor and runs its backward, which Inductor compiles
    at that first call under the same lock: ``in_worker`` lends the lock for the wait, so the step finishes
    with the right gradients and the outer compile has its lock back. In a subprocess with a time limit: a
    worker left waiting for the lock would hang this process, not fail."""
    out = _run_script(_NESTED_STEP, timeout=300)
    assert "owned True gradients ok True" in out, out[-2000:]


_NESTED_FUSED = """
import torch
from torch._dynamo.utils import counters
from fusenorm_inductor import report
from fusenorm_inductor.tuning import baseline
from fusenorm_inductor.tuning.deferred_norm import STEP_PATCHES

def site(n, rms):
    torch.manual_seed(n)
    a, b, bias = torch.randn(37, 24), torch.randn(24, n) / 5, torch.randn(n)
    w, nb = torch.randn(n), (None if rms else torch.randn(n))
    cons = [(torch.randn(n, 16) / n ** 0.5, torch.randn(16)), (torch.randn(n, 8) / n ** 0.5, None)]
    fn, inputs = baseline.norm_site_fn(a, b, bias, None, w, nb, 1e-5, rms, cons, with_y=False)
    leaves, wants = baseline._leaves(inputs)
    compiled = baseline.compile_fused(fn, leaves, STEP_PATCHES, "deferred_norm")
    dz = [torch.randn(37, 16), torch.randn(37, 8)]
    got = torch.autograd.grad(compiled(*leaves), wants, dz)
    ref = [t.detach().double().requires_grad_() for t in inputs]
    want = torch.autograd.grad(fn(*ref), ref, [g.double() for g in dz])
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double(), r, rtol=1e-3, atol=1e-3)
    return f"site {n} ok"

def backend(gm, example_inputs):
    snapshot = lambda: (report.reports(), {k: dict(v) for k, v in counters.items() if v})
    before = snapshot()
    out = baseline.in_worker(lambda: site(40, False) + "; " + site(48, True))
    print(out, "| aside", snapshot() == before, flush=True)
    return gm.forward

torch.compile(lambda t: t + 1, backend=backend)(torch.randn(4))
"""


def test_a_site_compiled_by_fusenorm_inside_an_outer_compile_defers_and_keeps_apart():
    """What a deferred training site's decision times (``compile_fused``): inside another compile, the site
    (linear -> norm -> two linears, LayerNorm and RMSNorm, N = 40 / 48) compiled by fusenorm with its norm
    deferred (``compile_fused`` raises where the deferred_norm rewrite was not made), its gradients equal
    the site's in fp64, twice in one process (a fresh code object each: Dynamo would otherwise reuse or
    count the first), and the outer compile's reports and counters are untouched."""
    out = _run_script(_NESTED_FUSED, timeout=300)
    assert "site 40 ok; site 48 ok | aside True" in out, out[-2000:]


def test_enabled_only_on_cuda_and_by_config():
    assert not baseline.enabled(torch.device("cpu"))
    with config.patch({"tuning.measure_inductor": True}):
        assert baseline.enabled(torch.device("cuda"))
    with config.patch({"tuning.measure_inductor": False}):
        assert not baseline.enabled(torch.device("cuda"))


@pytest.mark.parametrize("by, pair_us, used_us, fused", [("inductor", 27.0, 27, False), ("inductor", None, 60, True),
                                                      ("inductor", 70.0, 60, True), ("estimate", 27.0, 27, False)])
def test_decision_uses_inductors_time_and_the_lower_host_time(monkeypatch, by, pair_us, used_us, fused):
    """An entry measured against Inductor's compiled subgraph carries that subgraph's GPU and host times; the
    decision weighs the lower of its host time and the bare pair's (cuBLAS call + one launch: a user's step
    pays the subgraph's wrapper once per graph, not per site) and names what it compared against. 0.05 ms
    fused with 45 us of host time against 0.1 ms unfused: with 60 us unfused host time the fused side wins
    (0.09 < 0.12 * 0.85); with 27 us it does not (0.09 vs 0.1)."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(measure, "can_measure", lambda device: True)
    monkeypatch.setattr(measure, "lookup", lambda key: None)
    monkeypatch.setattr(measure, "store", lambda key, entry, bucket=False: None)
    monkeypatch.setattr(measure, "unfused_host_us", lambda device: pair_us)
    from fusenorm_inductor.kernels.triton.common import GemmConfig

    cfg = GemmConfig("gl_coop", 128, 128, 64, 4, 4)
    entry = measure.make_entry(cfg, {cfg: 0.05}, 0.1, 45.0, (0.1, 60.0) if by == "inductor" else None)
    with config.patch({"tuning.host_weight": 2.0}), inductor_config.patch({"triton.cudagraphs": False}):
        choice = tuning._choice(("k",), torch.device("cuda"), lambda: entry, lambda: "first")
    assert choice.fuse is fused, choice
    assert f"vs {used_us} us unfused" in choice.reason, choice.reason
    what = "Inductor's compiled unfused subgraph" if by == "inductor" else "norm at copy speed"
    assert what in choice.reason, choice.reason


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_decision_measures_inductors_code_inside_a_fusenorm_compile(tmp_path, recwarn):
    """On the GPU, with measuring on and an empty tuning cache, compiling linear -> LayerNorm with fusenorm
    times Inductor's own code for the subgraph from inside the outer compile: the report's reason names it,
    the cached entry holds its GPU and host times next to the estimate, and the output (fused or not) matches
    an fp32 reference."""
    import torch.nn as nn

    import fusenorm_inductor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 128), nn.LayerNorm(128)).cuda().to(torch.bfloat16)
    x = torch.randn(8192, 256, device="cuda", dtype=torch.bfloat16)
    measure.clear_memory()
    measure._warned.clear()  # a failing nested compile warns here even if an earlier test's did
    try:
        with config.patch({"tuning.measure": True, "tuning.measure_inductor": True, "tuning.cache_dir": str(tmp_path),
                           "tuning.rep_ms": 5.0}), torch.no_grad():
            torch._dynamo.reset()
            fusenorm_inductor.report.clear()
            y = torch.compile(model, backend="fusenorm", dynamic=False)(x)
        reps = fusenorm_inductor.report.reports()
        entries = [e for e in measure._memo.values() if isinstance(e, dict) and "unfused_by" in e]
    finally:
        measure.clear_memory()
        torch._dynamo.reset()
    reasons = [r.detail for rep in reps for r in rep.rewrites] + [s.reason for rep in reps for s in rep.skips]
    assert any("Inductor's compiled unfused subgraph" in r for r in reasons), "\n".join(
        reasons + [repr(entries)] + [str(w.message) for w in recwarn])
    assert entries and all(e["unfused_by"] == "inductor" for e in entries), entries
    for e in entries:
        assert 0 < e["t_unfused_ms"] < float("inf") and e["h_unfused_us"] > 0 and e["t_unfused_estimate_ms"] > 0, e
    with torch.no_grad():
        want = nn.functional.layer_norm(x.float() @ model[0].weight.float().t() + model[0].bias.float(), (128,),
                                        model[1].weight.float(), model[1].bias.float())
    torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2)


_TRAINING_STEP = """
import tempfile
import torch
import torch.nn as nn
import fusenorm_inductor
from fusenorm_inductor import config

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256)).cuda().to(torch.bfloat16)
x = torch.randn(8192, 256, device="cuda", dtype=torch.bfloat16)
with config.patch({"tuning.measure": True, "tuning.measure_inductor": True,
                   "tuning.cache_dir": tempfile.mkdtemp(), "tuning.rep_ms": 5.0}):
    y = torch.compile(model, backend="fusenorm", dynamic=False)(x)
    y.float().square().mean().backward()
torch.cuda.synchronize()
ref = nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256)).cuda()
ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
ref(x.float()).square().mean().backward()
torch.testing.assert_close(model[0].weight.grad.float(), ref[0].weight.grad, rtol=5e-2, atol=5e-3)
reasons = [s.reason for rep in fusenorm_inductor.report.reports() for s in rep.skips]
reasons += [r.detail for rep in fusenorm_inductor.report.reports() for r in rep.rewrites]
print("step done;", " | ".join(reasons)[:2000])
"""


@cuda
def test_a_training_step_with_a_narrow_post_norm_compiles_inside_fusenorm():
    """On the GPU, the first training step of linear -> LayerNorm (a 256-wide row: the post-norm epilogue's
    training decision times Inductor's whole step, whose backward Inductor compiles lazily under dynamo's
    compile lock) finishes and trains as the fp32 model does. In a subprocess with a time limit: this hung
    before the outer compile lent the lock to the nested one."""
    out = _run_script(_TRAINING_STEP, timeout=900)
    assert "step done" in out, out[-2000:]


@pytest.mark.parametrize("t_fused,h_fused,cudagraphs,want", [
    (0.85, 10.0, False, True),    # on the line (0.85 x 1.0): Inductor's code decides
    (0.60, 10.0, False, False),   # a clear win against the estimate
    (1.20, 10.0, False, False),   # a clear loss
    (0.30, 400.0, False, True),   # host-bound fused call: the unfused side's host time decides
    (0.30, 400.0, True, False),   # ... unless host time does not count (CUDA graphs)
    (float("inf"), 10.0, False, False),  # nothing to compare
])
def test_worth_measuring_only_where_it_can_turn_the_decision(monkeypatch, t_fused, h_fused, cudagraphs, want):
    """Inductor's code is compiled only where it can change the verdict: near the margin's line (estimate 1 ms,
    Gluon margin 0.15) or where host time decides; elsewhere the estimate decides and no nested compile runs."""
    import torch._inductor.config as inductor_config

    with config.patch({"tuning.measure_inductor": True, "tuning.margin_gluon": 0.15, "tuning.host_weight": 2.0}), \
            inductor_config.patch({"triton.cudagraphs": cudagraphs}):
        got = baseline.worth_measuring(torch.device("cuda"), t_fused, h_fused, 1.0, "gl_coop 128x128x64 s4 w4")
        assert got is want
        assert baseline.worth_measuring(torch.device("cuda"), 0.5, h_fused, None, "gl_coop")  # no estimate
    with config.patch({"tuning.measure_inductor": False}):
        assert not baseline.worth_measuring(torch.device("cuda"), 0.85, 10.0, 1.0, "gl_coop")
    assert not baseline.worth_measuring(torch.device("cpu"), 0.85, 10.0, 1.0, "gl_coop")


@pytest.mark.parametrize("is_rms,src_is_normed,with_extra,affine", [(False, False, True, True), (True, True, False, True),
                                                                    (False, True, False, False)],
                         ids=["ln-from-x-extra", "rms-from-hh", "ln-from-hh-noaffine"])
def test_dgrad_norm_subgraph_matches_reference(is_rms, src_is_normed, with_extra, affine):
    from fusenorm_inductor.ops.mm_norm_backward import mm_norm_backward_reference

    m, k, n = 37, 24, 40
    gen, dy, b = _gemm(4, m, k, n)
    extra = _rand(m, n, gen=gen) if with_extra else None
    src = _rand(m, n, gen=gen) * 2 + 0.5
    w = _rand(n, gen=gen) if affine else None
    rstd = torch.rand(m, generator=gen) + 0.5
    mean = _rand(m, gen=gen) if not (is_rms or src_is_normed) else None
    args = (dy, b, extra, src, w, mean, rstd, is_rms, src_is_normed, affine, torch.float32)
    _assert_compiled_matches(*baseline.dgrad_norm_fn(*args), tuple(mm_norm_backward_reference(*args)))
