"""tuning/measure.py and tuning/decide.py (tuning/mm_norm.py for the post-norm, tuning/norm_mm.py for the
pre-norm): the per-shape kernel choice and the fuse-or-not decision, and their cache.

CPU: nothing is measured (every match fuses, the kernels' first candidate runs), the config rules, the disk
cache round trip. CUDA: a real measurement is cached on disk and found again by a fresh process state, and
the launcher uses the cached choice even while a CUDA graph is captured (where it must not measure).
"""

import json
import re

import pytest
import torch

from fusenorm_inductor import config
from fusenorm_inductor.kernels.triton import common
from fusenorm_inductor.tuning import baseline, decide as tuning, measure
from fusenorm_inductor.tuning import norm_mm as norm_mm_tuning
from fusenorm_inductor.tuning import mm_norm as mm_norm_tuning


@pytest.fixture(autouse=True)
def _fresh(tmp_path):
    measure.clear_memory()
    with config.patch({"tuning.cache_dir": str(tmp_path)}):
        yield
    measure.clear_memory()


def _fwd_args(device, m=4096, k=256, n=256, dtype=torch.bfloat16):
    a = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype)
    return (a, w.t(), None, None, torch.ones(n, device=device), None, 1e-5, False, dtype, True)


def test_cpu_is_not_measured():
    choice = mm_norm_tuning.forward_choice(*_fwd_args("cpu", m=33, k=40, n=40, dtype=torch.float32))
    assert choice.fuse and choice.t_fused_ms is None and "not measured on CPU" in choice.reason


def test_smem_rule_and_grid():
    # A 128 x 256 fp32 output tile (128 KiB) leaves room for 2 pipeline stages of 64-deep K slices, not 3.
    assert common.tma_config("row", 128, 256, 64, 3, 8, out_bytes=4)[1:5] == (64, 256, 64, 3)
    assert common.tma_config("row", 128, 256, 64, 3, 8, out_bytes=2).stages == 3
    for n_tiles in (1, 3, 8, 16, 32):
        progs = common.cooperative_grid(torch.device("cpu"), n_tiles, 1)
        assert progs % n_tiles == 0 and progs >= n_tiles


def test_disk_cache_round_trip(tmp_path):
    key = ("mm_norm", torch.device("cpu"), ((8, 8), (8, 1), "torch.bfloat16"))
    entry = {"config": list(common.GemmConfig("row", 64, 64, 64, 3, 4)), "t_fused_ms": 1.0, "t_unfused_ms": 2.0,
             "candidates": {}}
    measure.store(key, entry)
    measure.clear_memory()
    assert measure.lookup(key) == entry
    files = list(tmp_path.glob("tuning-v*.json"))
    assert len(files) == 1 and len(json.loads(files[0].read_text())) == 1


def _report_entries(*patterns) -> list[str]:
    """The kernel text of every rewrite and the reason of every skip of these patterns, all graphs."""
    import fusenorm_inductor

    entries = []
    for rep in fusenorm_inductor.reports():
        entries += [r.kernel for r in rep.rewrites if r.pattern in patterns]
        entries += [s.reason for s in rep.skips if s.pattern in patterns]
    return entries


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# A reason that carries measured times ("not measured on CPU" must not pass for one).
MEASURED = re.compile(r"\(measured [0-9.e+-]+ ms fused")


@cuda
def test_measured_choice_is_cached(monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA kernels need sm_90+")
    args = _fwd_args("cuda", m=65536)
    with config.patch({"tuning.measure": True}):
        choice = mm_norm_tuning.forward_choice(*args)
        assert choice.t_fused_ms > 0 and choice.t_unfused_ms > 0, choice
        assert choice.reason.startswith("fused" if choice.fuse else "left unfused"), choice.reason
        # A new process state reads the disk cache instead of measuring again.
        measure.clear_memory()
        monkeypatch.setattr(mm_norm_tuning, "measure_forward", lambda *a, **k: pytest.fail("measured twice"))
        again = mm_norm_tuning.forward_choice(*args)
        assert (again.config, again.t_fused_ms) == (choice.config, choice.t_fused_ms)
        assert mm_norm_tuning.forward_config(*args).label() == choice.config


@cuda
def test_capture_uses_cached_config(monkeypatch, tmp_path):
    """While a CUDA graph is captured nothing is measured, but a cached choice is still used (a
    ``mode="reduce-overhead"`` step must run the tuned kernel, not the first candidate)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA kernels need sm_90+")
    args = _fwd_args("cuda")
    a, b, bias, residual, weight, norm_bias, _eps, _rms, out_dtype, save_normed = args
    out_bytes = mm_norm_tuning.forward_out_bytes(a, residual, out_dtype, save_normed)
    cands = mm_norm_tuning.forward_candidates(a, b, 256, out_bytes, (bias, residual, weight, norm_bias, out_dtype,
                                                                     save_normed))  # as forward_config
    assert len(cands) > 1
    key = mm_norm_tuning.forward_key(*args[:6], args[7], args[8], args[9])
    measure.store(key, {"config": list(cands[1]), "t_fused_ms": 1.0, "t_unfused_ms": 2.0, "candidates": {}})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with config.patch({"tuning.measure": True}):
        assert mm_norm_tuning.forward_config(*args) == cands[1]
    measure.clear_memory()  # no entry (an empty cache directory): the first candidate, nothing measured
    with config.patch({"tuning.measure": True, "tuning.cache_dir": str(tmp_path / "empty")}):
        monkeypatch.setattr(mm_norm_tuning, "measure_forward", lambda *a, **k: pytest.fail("measured during capture"))
        assert mm_norm_tuning.forward_config(*args) == cands[0]


@cuda
def test_compile_measures_and_reports(recwarn):
    """The default path on CUDA: the patterns measure at compile time (inside the joint-graph pass, under
    fake tensors) and either fuse or leave the match unfused, naming the measured times in the report."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA kernels need sm_90+")
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, 64))
    model = model.to("cuda", torch.bfloat16)
    x = torch.randn(32768, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with config.patch({"tuning.measure": True}):
        out = torch.compile(model, backend="fusenorm", dynamic=False)(x)
        out.float().square().mean().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    entries = _report_entries("linear_norm_fwd", "dgrad_norm_bwd")
    assert entries and all(MEASURED.search(e) for e in entries), entries
    if not _report_entries("dgrad_norm_bwd"):
        # The forward left unfused, so the norm went back as traced (patterns/prospects.py): the backward's
        # decision was asked there, and its reason is in that entry.
        prospects = _report_entries("norm_prospects")
        assert any("dgrad_norm_bwd: " in p for p in prospects), prospects
    assert not [w for w in recwarn if "fusenorm" in str(w.message)], [str(w.message) for w in recwarn]


def test_prenorm_measurement_plumbing(monkeypatch):
    """The pre-norm dispatch's measuring path with the timer replaced (on CPU the kernels run in the
    interpreter, on a GPU compiled): every candidate and the GEMM are run once, the entry is cached, the
    verdict follows the margin."""
    runs = []

    def fake_time(fn, give_up_ms=None):
        fn()
        runs.append(fn)
        return 1.0

    monkeypatch.setattr(measure, "can_measure", lambda device: True)
    monkeypatch.setattr(measure, "time_ms", fake_time)
    monkeypatch.setattr(measure, "norm_proxy_ms", lambda *a: 0.5)  # unfused = 1.0 + 0.5
    monkeypatch.setattr(baseline, "enabled", lambda device: False)  # the estimate's plumbing (test_baseline.py)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a, w = (torch.randn(65, 40, dtype=torch.float16, device=dev), torch.randn(24, 40, dtype=torch.float16, device=dev))
    args = (a, w.t(), None, torch.ones(40, device=dev), None, 1e-5, False, torch.float16)
    choice = norm_mm_tuning.prenorm_choice(*args)
    assert len(runs) >= 2 and choice.fuse and "measured 1 ms fused" in choice.reason, choice
    monkeypatch.setattr(norm_mm_tuning, "measure_prenorm", lambda *a, **k: pytest.fail("measured twice"))
    assert norm_mm_tuning.prenorm_choice(*args) == choice
    with config.patch({"tuning.margin": 0.5, "tuning.margin_gluon": 0.5}):  # 1.0 is not below 1.5 * 0.5
        measure.clear_memory()
        assert not norm_mm_tuning.prenorm_choice(*args).fuse


@pytest.mark.parametrize(
    "fan_out, train, t_fused, fused, why",
    [
        (1, False, 1.0, True, None),
        (3, False, 1.0, False, "(measured 3 ms fused [3 GEMM(s)] vs 2.5 ms"),
        (1, True, 1.0, False,
         "(measured 2 ms fused [1 GEMM(s) + 1 rebuild(s) of norm(x) for the weight gradients] vs 1.5 ms"),
        (1, True, 0.1, True, None),
        (2, True, 0.1, False, "(measured 2.2 ms fused [2 GEMM(s) + 2 rebuild(s)"),
    ],
    ids=["infer-1", "infer-3", "train-1-loses", "train-1-wins", "train-2-loses"],
)
def test_prenorm_dispatch_weighs_the_sums(monkeypatch, fan_out, train, t_fused, fused, why):
    """Each consumer is measured at ``t_fused`` vs 1.5 ms unfused, of which the norm is 1.0 (margin 20%).
    Inference: three fused GEMMs (3.0 ms) lose to one norm + three GEMMs (2.5 ms). Training adds a rebuild
    of norm(x) (1.0 ms) per weight gradient to the fused side: 1.0 + 1.0 loses to 1.5; 0.1 + 1.0 wins;
    2 x (0.1 + 1.0) loses to 1.0 + 2 x 0.5."""
    from fusenorm_inductor.patterns import pre_norm

    from .test_pre_norm import PreNormBlock

    monkeypatch.setattr(pre_norm, "prenorm_choice",
                        lambda *a, **k: tuning.Choice(True, "fake", "fused (measured)", t_fused, 1.5))
    monkeypatch.setattr(pre_norm, "prenorm_norm_ms", lambda a: 1.0)
    model = PreNormBlock(32, 24, "nn.LayerNorm", fan_out=fan_out).requires_grad_(train)
    x = torch.randn(33, 32)
    torch.testing.assert_close(torch.compile(model, backend="fusenorm")(x), model(x), atol=1e-4, rtol=1e-4)
    from torch._dynamo.utils import counters

    assert ("norm_linear_fwd" in counters["fusenorm"]) == fused
    if not fused:
        import fusenorm_inductor

        reasons = [s.reason for s in fusenorm_inductor.last_report().skips if s.pattern == "norm_linear_fwd"]
        assert any(why in r for r in reasons), reasons


@cuda
def test_compile_measures_prenorm(recwarn):
    """norm -> linear on CUDA with measuring on: the pre-norm pattern measures at compile time and fuses or
    leaves the match unfused with the measured times in the report; no warning (no pass fell back)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("the TMA kernels need sm_90+")
    model = torch.nn.Sequential(torch.nn.RMSNorm(256), torch.nn.Linear(256, 256)).to("cuda", torch.bfloat16)
    x = torch.randn(65536, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with config.patch({"tuning.measure": True}):
        out = torch.compile(model, backend="fusenorm", dynamic=False)(x)
        out.float().square().mean().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    entries = _report_entries("norm_linear_fwd")
    assert entries and all(MEASURED.search(e) for e in entries), entries
    assert not [w for w in recwarn if "fusenorm" in str(w.message)], [str(w.message) for w in recwarn]


@pytest.mark.parametrize("kind, fused", [("gl_coop", True), ("row", False)])
def test_gluon_configs_fuse_at_their_own_margin(monkeypatch, kind, fused):
    """17% under the unfused estimate: above the Gluon kernels' margin (15%), below the tl kernels' (20%)."""
    monkeypatch.setattr(measure, "can_measure", lambda device: True)
    monkeypatch.setattr(measure, "lookup", lambda key: None)
    monkeypatch.setattr(measure, "store", lambda key, entry, bucket=False: None)
    entry = {"config": [kind, 128, 128, 64, 4, 4], "t_fused_ms": 0.83, "t_unfused_ms": 1.0, "candidates": {}}
    choice = tuning._choice(("k",), torch.device("cuda"), lambda: entry, lambda: "first")
    assert choice.fuse is fused and choice.config.startswith(kind), choice
    with config.patch({"tuning.margin_gluon": 0.2, "tuning.margin": 0.15}):
        assert tuning._choice(("k",), torch.device("cuda"), lambda: entry, lambda: "first").fuse is not fused


@pytest.mark.parametrize("cudagraphs, weight, fused", [(False, 2.0, False), (True, 2.0, True), (False, 0.0, True),
                                                       (False, 1.0, True)])
def test_host_time_counts_without_cuda_graphs(monkeypatch, cudagraphs, weight, fused):
    """A fused kernel of 0.05 ms against 0.1 ms unfused, with 45 us of host time per fused call against 27 us
    for the unfused pair: without CUDA graphs and host times weighted 2x it is 0.09 vs 0.1 ms, not 15% faster
    (left unfused, the reason gives the host times); under CUDA graphs (mode="reduce-overhead"), with host
    times ignored (weight 0) or counted once, it fuses."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(measure, "can_measure", lambda device: True)
    monkeypatch.setattr(measure, "lookup", lambda key: None)
    monkeypatch.setattr(measure, "store", lambda key, entry, bucket=False: None)
    monkeypatch.setattr(measure, "unfused_host_us", lambda device: 27.0)
    entry = {"config": ["gl_coop", 128, 128, 64, 4, 4], "t_fused_ms": 0.05, "t_unfused_ms": 0.1, "candidates": {},
             "h_fused_us": 45.0}
    with config.patch({"tuning.host_weight": weight}), inductor_config.patch({"triton.cudagraphs": cudagraphs}):
        choice = tuning._choice(("k",), torch.device("cuda"), lambda: entry, lambda: "first")
    assert choice.fuse is fused, choice
    assert ("host 45 us fused vs 27 us unfused" in choice.reason) is (not cudagraphs and weight > 0), choice.reason


def test_measuring_time_is_accounted(monkeypatch):
    """Every timed call and host-time loop adds its wall time to ``measure.spent_seconds()`` by part, also when it
    fails (here a function that raises), so the benchmark can say what the decisions cost a first compile."""
    import time

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)  # runs on CPU-only torch too
    before = measure.spent_seconds()

    def slow():
        time.sleep(0.02)
        raise RuntimeError("not timeable")

    assert measure.time_ms(slow) == float("inf")
    assert measure.host_us(slow) is None
    after = measure.spent_seconds()
    for part in ("first_call", "host"):
        assert after.get(part, 0.0) - before.get(part, 0.0) >= 0.015, (part, before, after)


@pytest.mark.parametrize("first_ms,timed", [(2.5, 1), (1.5, 3)])
def test_candidates_after_a_hopeless_first_are_not_timed(monkeypatch, first_ms, timed):
    """A best guess over GIVE_UP (2x) the unfused estimate ends the timing (the others are left out); within it,
    every candidate is timed and the fastest kept."""
    times = iter([first_ms, 0.9, 1.2])
    monkeypatch.setattr(measure, "time_ms", lambda fn, give_up_ms=None: next(times))
    best, got = measure.time_candidates(["c0", "c1", "c2"], lambda c: None, unfused_ms=1.0)
    assert len(got) == timed and best == ("c0" if timed == 1 else "c1"), (best, got)
    times = iter([first_ms, 0.9, 1.2])
    best, got = measure.time_candidates(["c0", "c1", "c2"], lambda c: None)  # no estimate: all timed
    assert len(got) == 3


@pytest.mark.parametrize("unfused_ms", [None, 1.0])
def test_refused_candidates_are_left_out_and_the_entry_kept(monkeypatch, unfused_ms):
    """A candidate that spills (``SpillError``, a refusal) is left out of the times, even as the best guess
    (it does not end the timing as a hopeless first would), so the entry stays finite and is written to the
    disk cache: a later process finds it. A candidate that failed otherwise (a transient error) keeps its inf
    and keeps the entry in this process only, as before."""
    import triton.testing

    from fusenorm_inductor.kernels.hopper.common import SpillError

    c0, c1, c2, c3 = (common.GemmConfig("gl_pp", 128, bn, 64, 5, 4) for bn in (32, 64, 128, 256))
    errors = {c0: SpillError("spills"), c2: RuntimeError("a transient failure")}
    speed, last = {c1: 1.2, c2: 0.5, c3: 0.9}, []

    def run(c):
        last.append(c)
        if c in errors:
            raise errors[c]

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, rep, return_mode: speed[last[-1]])
    monkeypatch.setattr(measure, "_one_call_ms", lambda fn: fn() or speed[last[-1]])
    best, got = measure.time_candidates([c0, c1, c2, c3], run, unfused_ms)
    assert best == c3 and list(got) == [c1, c2, c3] and got[c2] == float("inf"), got
    key = ("mm_norm", torch.device("cpu"), ((8, 8), (8, 1), "torch.bfloat16"))
    measure.store(key, measure.make_entry(best, got, 2.0))
    measure.clear_memory()
    assert measure.lookup(key) is None  # the transient failure: measured again next time
    del errors[c2]
    best, got = measure.time_candidates([c0, c1, c2, c3], run, unfused_ms)
    assert best == c2 and list(got) == [c1, c2, c3]
    measure.store(key, measure.make_entry(best, got, 2.0))
    measure.clear_memory()
    entry = measure.lookup(key)
    assert measure.config_of(entry) == c2 and c0.label() not in entry["candidates"]
    assert measure.time_candidates([c0], run) == (c0, {c0: float("inf")})  # nothing can run


@pytest.mark.parametrize("threads", [1, 2, 8])
def test_candidates_compile_ahead_in_parallel_threads(monkeypatch, threads):
    """Before the timing, every candidate's first call runs in up to ``tuning.compile_threads`` threads at once
    (not the caller's; one that raises is left to the timing), then each is timed in order as before; with
    one thread nothing runs ahead."""
    import threading

    for name, fake in (("is_available", lambda: True), ("current_device", lambda: 0),
                       ("set_device", lambda d: None), ("synchronize", lambda *a: None)):
        monkeypatch.setattr(torch.cuda, name, fake)
    lock, live, calls = threading.Lock(), [0, 0], []
    barrier = threading.Barrier(min(threads, 4)) if threads > 1 else None

    def run(c):
        with lock:
            calls.append((c, threading.current_thread() is threading.main_thread()))
            live[0] += 1
            live[1] = max(live[1], live[0])
        if barrier is not None and c in ("c0", "c1", "c2", "c3")[:barrier.parties]:
            barrier.wait(timeout=30)  # only passes where that many first calls run at once
        with lock:
            live[0] -= 1
        if c == "c2":
            raise RuntimeError("does not compile")

    timed = []
    monkeypatch.setattr(measure, "time_ms", lambda fn, give_up_ms=None: timed.append(1) or 1.0)
    with config.patch({"tuning.compile_threads": threads}):
        measure.time_candidates(["c0", "c1", "c2", "c3", "c4"], run)
    ahead = [c for c, main in calls if not main]
    assert len(timed) == 5
    if threads == 1:
        assert not calls
    else:
        assert sorted(ahead) == ["c0", "c1", "c2", "c3", "c4"] and 2 <= live[1] <= threads, (calls, live)


@pytest.mark.parametrize("gpu_ms,calls", [(None, 20), (0.01, 20), (1.0, 4), (50.0, 3)])
def test_host_loops_shrink_for_long_kernels(monkeypatch, gpu_ms, calls):
    """A host-time loop queues about 4 ms of GPU work at most (at least 3 calls): the sync after it is what the
    first compile waits for, and a long kernel's host time is no less steady over fewer calls."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    n = []
    assert measure.host_us(lambda: n.append(1), repeats=2, gpu_ms=gpu_ms) is not None
    assert len(n) == 1 + 2 * calls, len(n)  # one warm-up call, then the loops


@pytest.mark.parametrize("quick_ms,give_up_ms,expected", [
    (5.0, 2.0, 5.0),     # hopeless: the quick look's time, no full timing
    (5.0, 10.0, 4.0),    # could win: timed in full
    (5.0, None, 4.0),    # no give-up time: timed in full, no quick look
    (None, 0.02, 4.0),   # a host-bound call: the events timed its launch, not the kernel: timed in full
])
def test_quick_look_skips_the_full_timing_of_a_hopeless_candidate(monkeypatch, quick_ms, give_up_ms, expected):
    """A candidate whose single calls already take over the give-up time keeps that time without the CUDA-graph
    timing (most of a decision's cost to the first step); otherwise, or without a give-up time, it is timed."""
    import triton.testing

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    looks = []
    monkeypatch.setattr(measure, "_one_call_ms", lambda fn: looks.append(fn) or quick_ms)
    full = []
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn, **kw: full.append(fn) or 4.0)
    assert measure.time_ms(lambda: None, give_up_ms) == expected
    assert len(looks) == (measure.QUICK_LOOKS if give_up_ms is not None else 0)
    assert len(full) == (0 if expected == quick_ms else 1)
