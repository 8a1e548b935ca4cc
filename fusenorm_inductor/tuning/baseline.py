"""The unfused side of the fuse decision, measured as the user would run it: the matched subgraph written as
plain torch ops, compiled by Inductor (``compile_fx``; fusenorm's passes stand aside: ``in_baseline_compile``) and timed on the same
random inputs as the fused kernels (the way Inductor's pad_mm times both sides of its own decision).

Inductor compiles the subgraph as it compiles the user's: cuBLAS for the GEMM (addmm where it folds the bias
in) and one generated Triton kernel for the bias/residual add and the norm. Its GPU time (CUDA graphs) and
its host time per call (the compiled wrapper's, without CUDA graphs) both go into the decision.

The compile runs in a worker thread: the outer compile's fake mode, tracing context and Inductor's
virtualized graph are thread-local, so the nested compile sees none of them, and the outer one waits for it
(``in_worker``), handing the worker dynamo's compile lock meanwhile: Inductor compiles a backward lazily, at
its first call, under that lock, which the outer compile holds.
When it fails (any exception), ``time_compiled`` warns once per reason and returns None: the decision then
falls back to the estimate (cuBLAS + a norm at copy speed, ops/measure.py) and its reason says so.
``config.tuning.measure_inductor`` off uses the estimate without compiling (a first compile is shorter).

The post-norm, pre-norm and regrouped-backward decisions use it (``post_norm_fn``, ``pre_norm_fn``,
``dgrad_norm_fn``), where it can turn their verdict (``worth_measuring``).

In a training graph a site whose forward won is judged by its whole step (``time_training_steps``): Inductor's
forward and backward of the unfused site against the fused side's, compiled by Inductor around the fused op
(post-norm, whose op has its own autograd) or by fusenorm itself (``compile_fused``: deferral, whose backward
is what the joint-graph rewrite makes of the site).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import statistics
import threading
import time
import types
from typing import Callable, Optional

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch import Tensor

from .. import config
from . import measure
from ..norm_math import norm_backward_reference

__all__ = ["compile_fused", "compile_unfused", "dgrad_norm_fn", "in_baseline_compile", "norm_site_fn", "post_norm_fn",
           "pre_norm_fn", "time_compiled", "time_training_steps", "unfused_where_it_counts", "worth_measuring"]


def _norm(h: Tensor, weight, norm_bias, eps: float, is_rms: bool) -> Tensor:
    """The norm as a user's model writes it (torch's functional forms, which Inductor decomposes), in h's
    dtype: the fused ops take norm parameters of any float dtype (fp32 with bf16 activations, say), which
    torch's norms refuse to mix; a parameter vector's dtype does not change what the norm costs."""
    n = (h.shape[-1],)
    weight = weight.to(h.dtype) if weight is not None else None
    norm_bias = norm_bias.to(h.dtype) if norm_bias is not None else None
    if is_rms:
        return F.rms_norm(h, n, weight, eps)
    return F.layer_norm(h, n, weight, norm_bias, eps)


def _over_present(names: tuple, values: tuple, body: Callable[[dict], object]):
    """(fn, inputs): ``body`` over a dict of the tensors given (Inductor's compiled callables take tensors, not
    None), fn taking them positionally in ``names`` order."""
    present = [(k, v) for k, v in zip(names, values) if v is not None]
    keys = [k for k, _ in present]

    def fn(*ts):
        return body(dict(zip(keys, ts)))

    return fn, [v for _, v in present]


def post_norm_fn(a, b, bias, residual, weight, norm_bias, eps: float, is_rms: bool, out_dtype):
    """(fn, inputs): the unfused ``norm(a @ b + bias + residual)``."""

    def body(t):
        h = torch.addmm(t["bias"], t["a"], t["b"]) if "bias" in t else t["a"] @ t["b"]
        if "residual" in t:
            h = h + t["residual"]
        return _norm(h, t.get("weight"), t.get("norm_bias"), eps, is_rms).to(out_dtype or t["a"].dtype)

    return _over_present(("a", "b", "bias", "residual", "weight", "norm_bias"),
                         (a, b, bias, residual, weight, norm_bias), body)


def pre_norm_fn(a, b, bias, weight, norm_bias, eps: float, is_rms: bool, out_dtype):
    """(fn, inputs): the unfused ``norm(a) @ b + bias``."""

    def body(t):
        x = _norm(t["a"], t.get("weight"), t.get("norm_bias"), eps, is_rms)
        y = torch.addmm(t["bias"], x, t["b"]) if "bias" in t else x @ t["b"]
        return y.to(out_dtype or t["a"].dtype)

    return _over_present(("a", "b", "bias", "weight", "norm_bias"), (a, b, bias, weight, norm_bias), body)


def norm_site_fn(a, b, bias, residual, weight, norm_bias, eps: float, is_rms: bool, consumers: list,
                 with_y: bool = True):
    """A deferred norm's site unfused, as the user's graph computes it: the producer's linear (+ bias,
    + residual), the norm, each consumer's linear ((b, bias) each); returns y (unless not ``with_y``: a site
    whose y only the norm reads) and every consumer's output."""
    names = ("a", "b", "bias", "residual", "weight", "norm_bias") + tuple(
        f"{kind}{i}" for i in range(len(consumers)) for kind in ("cb", "cbias"))
    values = (a, b, bias, residual, weight, norm_bias) + tuple(t for pair in consumers for t in pair)

    def body(v):
        y = v["a"] @ v["b"] if "b" in v else v["a"]  # no b: the norm's input comes from pointwise code
        for k in ("bias", "residual"):
            if k in v:
                y = y + v[k]
        h = _norm(y, v.get("weight"), v.get("norm_bias"), eps, is_rms)
        outs = [y] if with_y else []
        for i in range(len(consumers)):
            z = h @ v[f"cb{i}"]
            outs.append(z + v[f"cbias{i}"] if f"cbias{i}" in v else z)
        return tuple(outs)

    return _over_present(names, values, body)


def dgrad_norm_fn(dy, b, extra, src, weight, mean, rstd, is_rms: bool, src_is_normed: bool, has_bias: bool,
                  dx_dtype):
    """(fn, inputs): the unfused data-gradient GEMM ``dy @ b (+ extra)`` in the activations' dtype (cuBLAS),
    then the norm's backward from the saved statistics (``norm_backward_reference``: the math of Inductor's
    own norm backward, which it compiles into its reductions the same way), dx, dw and db."""

    def body(t):
        dn = t["dy"] @ t["b"]
        if "extra" in t:
            dn = dn + t["extra"]
        return norm_backward_reference(dn, t["src"], t.get("weight"), t.get("mean"), t["rstd"], is_rms,
                                       src_is_normed, has_bias, dx_dtype)

    return _over_present(("dy", "b", "extra", "src", "weight", "mean", "rstd"),
                         (dy, b, extra, src, weight, mean, rstd), body)


_local = threading.local()


def in_baseline_compile() -> bool:
    """Whether this thread is compiling a baseline: fusenorm's passes then leave the graph alone, so the
    nested compile is plain Inductor's (a user's own passes still run: they are part of what the user runs)."""
    return getattr(_local, "on", False)


def compile_unfused(fn: Callable, inputs: list, training: bool = False,
                    decompositions: Optional[dict] = None) -> Callable:
    """fn traced to an aten graph and compiled by Inductor for these (real) inputs, as plain Inductor would
    (no CUDA graphs: the timer captures its own), with fusenorm's passes standing aside. ``training``: the
    inputs that require grad get gradients (AOTAutograd's forward and backward, as in a training step);
    ``decompositions``: added to Inductor's own. Runs in the calling thread; ``time_compiled`` and
    ``time_training_steps`` run it in a worker thread to keep it apart from an outer compile."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    was, _local.on = in_baseline_compile(), True
    try:
        with torch.set_grad_enabled(training):
            gm = make_fx(fn)(*inputs)
            table = {**select_decomp_table(), **decompositions} if decompositions else None
            with inductor_config.patch({"triton.cudagraphs": False}):
                return compile_fx(gm, list(inputs), decompositions=table)
    finally:
        _local.on = was


def _compile_lock():
    """Dynamo's compile lock (a reentrant lock the compiling thread holds), or None where this torch has none."""
    try:
        from torch._dynamo.convert_frame import compile_lock
    except ImportError:
        return None
    return compile_lock


def in_worker(work: Callable[[], object]):
    """``work()``'s result, run in a worker thread while this one waits (raises what it raised). Where this
    thread holds dynamo's compile lock (fusenorm's passes run inside a compile), the lock is released for the
    wait and taken back after, at its recursion depth: the worker's Inductor compiles a training step's
    backward under that lock at the step's first backward, and would otherwise wait for this thread forever.
    A torch whose lock cannot be lent that way gets no worker: RuntimeError, which the callers' fallback
    (the estimate) takes."""
    lock = _compile_lock()
    owned = lock is not None and getattr(lock, "_is_owned", lambda: False)()
    if owned and not (hasattr(lock, "_release_save") and hasattr(lock, "_acquire_restore")):
        raise RuntimeError("dynamo's compile lock cannot be released for a nested compile")
    state = lock._release_save() if owned else None
    try:
        # leaving the pool waits for the worker: the lock comes back once the worker is done
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fusenorm-baseline") as pool:
            future = pool.submit(work)
    finally:  # also where the wait was interrupted: the exception goes on with the lock held again
        if owned:
            lock._acquire_restore(state)
    return future.result()


# Rounds of ``time_compiled(..., against=)``: Inductor's code and the fused side timed in turn, medians.
ALTERNATING_ROUNDS = 3


def time_compiled(fn: Callable, inputs: list, what: str, against: Optional[Callable[[], object]] = None
                  ) -> Optional[tuple]:
    """(GPU ms under CUDA graphs, host us per call) of Inductor's code for fn on real CUDA ``inputs``; None
    (warned once per reason) when it cannot be compiled or run. ``what`` names the subgraph in the warning.
    ``against``: the fused side's call; then Inductor's code and it are timed in ``ALTERNATING_ROUNDS``
    alternating rounds and the result is (Inductor's median ms, host us, the fused side's median ms): the
    GPU's clock moves with its load (on the H200 the same GEMM measured 0.76-0.89 ms from one run to the
    next, docs/history/performance-log.md), so two sides timed one after the other can differ by more than a margin."""
    device = inputs[0].device

    def work():
        torch.cuda.set_device(device)
        with torch.no_grad():
            t0 = time.perf_counter()
            try:
                compiled = compile_unfused(fn, inputs)
            finally:
                measure.add_spent("inductor_compile", time.perf_counter() - t0)
            call = lambda: compiled(*inputs)  # noqa: E731
            if against is None:
                ms = measure.time_ms(call)
                return ms, (measure.host_us(call, gpu_ms=ms) if ms < float("inf") else None)
            mine, theirs = [], []
            for _ in range(ALTERNATING_ROUNDS):
                mine.append(measure.time_ms(call))
                theirs.append(measure.time_ms(against))
            ms = statistics.median(mine)
            return ms, (measure.host_us(call, gpu_ms=ms) if ms < float("inf") else None), statistics.median(theirs)

    try:
        out = in_worker(work)
        ms, us = out[:2]
    except Exception as e:  # noqa: BLE001 - the estimate stands in; the warning says why
        err = measure.first_line(e)
        measure.warn_once(("baseline", err), f"could not compile and time Inductor's code for the unfused {what} "
                                             f"({err}); the decision estimates it (cuBLAS + a norm at copy speed)")
        return None
    if not ms < float("inf"):
        measure.warn_once(("baseline", "run"), f"Inductor's code for the unfused {what} failed to run; the "
                                               f"decision estimates it (cuBLAS + a norm at copy speed)")
        return None
    return out


def _leaves(inputs: list) -> tuple[list, list]:
    """A training step's inputs (the floating ones require grad, as a layer's activations and parameters do)
    and those of them that get gradients."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    return leaves, [t for t in leaves if t.requires_grad]


def _step(compiled: Callable, leaves: list, wants: list) -> Callable[[], None]:
    """One training step of ``compiled``: the forward on ``leaves`` and the backward of every output to
    ``wants`` (random output gradients, drawn once)."""
    outs = compiled(*leaves)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    grads = [torch.randn_like(o) for o in outs]

    def step():
        o = compiled(*leaves)
        torch.autograd.grad(list(o) if isinstance(o, (list, tuple)) else [o], wants, grads)

    return step


_fresh = itertools.count()


def compile_fused(fn: Callable, inputs: list, patches: dict, expect: str) -> Callable:
    """``fn`` compiled by fusenorm as a user's ``torch.compile(..., backend="fusenorm")`` compiles it (Dynamo,
    fusenorm's passes, AOTAutograd's forward and backward where ``inputs`` require grad), with the fusenorm
    config ``patches`` applied while it compiles; a first call (and, in training, a backward) runs inside, so
    the lazily compiled backward is compiled under them too. Each call compiles a fresh copy of ``fn``'s code:
    Dynamo keeps its compiled frames per code object, and a decision measures many sites. The compile's
    report and counters stay apart from the outer compile's (``report.aside``). Raises where the compile made
    no ``expect`` rewrite (what it would time is not the fusion the caller judges)."""
    from .. import report

    code = fn.__code__.replace(co_name=f"fusenorm_site_{next(_fresh)}")
    fresh = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    # no AOTAutograd or FX graph cache: a hit would skip the passes, and counts the outer compile reads
    with config.patch(patches), report.aside() as made, \
            inductor_config.patch({"fx_graph_cache": False, "triton.cudagraphs": False}), \
            functorch_config.patch({"enable_autograd_cache": False}):
        # by its registered name (setup.py's entry point): this layer does not import the backend's
        compiled = torch.compile(fresh, backend="fusenorm", fullgraph=True, dynamic=False)
        wants = [t for t in inputs if t.requires_grad]
        if wants:
            _step(compiled, inputs, wants)()
        else:
            compiled(*inputs)
    if not any(r.rewrites and any(w.pattern == expect for w in r.rewrites) for r in made):
        raise RuntimeError(f"fusenorm's compile of the site made no {expect} rewrite")
    return compiled


def time_training_steps(build_fused: Callable[[list], Callable], build_unfused: Callable[[list], Callable],
                        inputs: list, what: str) -> Optional[tuple[float, float]]:
    """(fused ms, unfused ms): the median of one training step of each side, ``build_*(leaves)`` compiling it
    (``compile_fused`` / ``compile_unfused``) for the inputs as a training step takes them (the floating ones
    require grad), timed in ``ALTERNATING_ROUNDS`` alternating rounds as a training step runs (CUDA events
    around plain calls, no CUDA graphs), the backward of every output to every input. None (warned once per
    reason) where either cannot be compiled or run."""
    from triton.testing import do_bench

    device = inputs[0].device

    def work():
        torch.cuda.set_device(device)
        leaves, wants = _leaves(inputs)
        t0 = time.perf_counter()
        try:
            steps = [_step(build(leaves), leaves, wants) for build in (build_fused, build_unfused)]
        finally:
            measure.add_spent("inductor_compile", time.perf_counter() - t0)
        t1 = time.perf_counter()
        times: tuple[list, list] = ([], [])
        try:
            for _ in range(ALTERNATING_ROUNDS):
                for side, step in zip(times, steps):
                    side.append(float(do_bench(step, rep=config.tuning.rep_ms * 2, return_mode="median")))
        finally:
            measure.add_spent("timing", time.perf_counter() - t1)
        return statistics.median(times[0]), statistics.median(times[1])

    try:
        out = in_worker(work)
    except Exception as e:  # noqa: BLE001 - the decision then declines (it cannot judge the step)
        err = measure.first_line(e)
        measure.warn_once(("step", err), f"could not compile and time a training step of the {what} ({err})")
        return None
    return out if all(0 < t < float("inf") for t in out) else None


def enabled(device: torch.device) -> bool:
    return device.type == "cuda" and bool(config.tuning.measure_inductor)


# Inductor's code for these subgraphs ran within 10% of the estimate's GPU time on every shape measured on the
# H200 (docs/history/design-history.md); with twice that as slack, a fused time farther than this from the margin's line
# decides the same against either, and the nested compile is not worth its seconds.
BAND = 0.2


def worth_measuring(device: torch.device, t_fused: float, h_fused_us: Optional[float], t_estimate: Optional[float],
                    label: str) -> bool:
    """Whether to compile and time Inductor's code for the unfused side: on CUDA, with
    ``tuning.measure_inductor`` on, where the estimate is unknown, where the fused call is host-bound (then the
    unfused side's host time decides, and only Inductor's compiled wrapper gives it: 44-95 us per call on the
    H200 against the 27 us of a bare GEMM call and launch), or where the best fused time is within ``BAND`` of
    the line the decision draws, (1 - margin) x the unfused time. Elsewhere the estimate decides (the entry
    says so: "unfused_by": "estimate")."""
    if not enabled(device) or not t_fused < float("inf"):
        return False
    if not t_estimate:
        return True
    if measure.host_counts() and h_fused_us and config.tuning.host_weight * h_fused_us / 1e3 >= t_fused:
        return True
    ratio = t_fused / (t_estimate * (1.0 - measure.margin_for(label)))
    return 1.0 / (1.0 + BAND) <= ratio <= 1.0 + BAND


def unfused_where_it_counts(device: torch.device, t_fused: float, h_fused_us: Optional[float],
                            t_estimate: Optional[float], label: str, built: tuple, what: str):
    """What the measuring functions call: ``time_compiled(*built, what)`` where ``worth_measuring`` says so,
    else None (the estimate decides). ``built``: (fn, inputs) from ``post_norm_fn`` / ``pre_norm_fn`` /
    ``dgrad_norm_fn``."""
    if not worth_measuring(device, t_fused, h_fused_us, t_estimate, label):
        return None
    return time_compiled(*built, what)
