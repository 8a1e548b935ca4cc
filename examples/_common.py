"""What the training examples (and ``benchmarks/bench_models.py``) share: the same model trained from the same
seed with ``backend="fusenorm"`` and with plain Inductor, step times, loss-curve agreement, fusenorm's match
report, and the plot / JSON output.

One comparison (``compare``):
    base = make_model() under torch.manual_seed(seed)          # built once; every backend trains a deepcopy
    for backend in ("fusenorm", "inductor"):
        torch._dynamo.reset(); model = torch.compile(deepcopy(base), backend=backend, dynamic=False)
        train ``steps`` steps (forward, backward, AdamW step) on the same batches, in the same order
Step times: on CUDA one pair of CUDA events per step (no host sync inside the loop: the loss values are read
back after the last step), on the CPU wall clock. The first step includes compilation; its wall time is kept
separately (``first_step_s``) and the step time reported is the median of the last ``timed`` steps.
Peak memory: ``torch.cuda.max_memory_allocated`` over the run (model, optimizer state, batches, activations).

Graph caches: Inductor's FX graph cache and AOTAutograd's cache are switched off while compiling (a cache hit
would skip fusenorm's passes, and with them the match report); kernel caches stay on.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.nn as nn

if importlib.util.find_spec("fusenorm_inductor") is None:  # a checkout that is not pip-installed
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BACKENDS = ("fusenorm", "inductor")
LOSS_TOL = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 3e-2}
"""Allowed relative difference of the two runs' mean loss over the last steps (``loss_agreement``). fp32: the
two graphs sum in different orders only (the CPU runs agree to ~1e-6). bf16/fp16: two graphs that round at
different places drift apart step by step like any two bf16 runs; the mean over the tail of the run stays
within a few % (an error in a fused kernel shows up as a loss that is off by far more, or not decreasing)."""


def pick_device(dtype: Optional[str] = None, device: Optional[str] = None) -> tuple[str, torch.dtype]:
    """("cuda", bf16) where a GPU is present, else ("cpu", fp32); ``device`` and ``dtype`` (names) override."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is available")
    default = "bfloat16" if device == "cuda" else "float32"
    if device == "cpu":
        import fusenorm_inductor

        # On the CPU fusenorm leaves graphs to Inductor unless told otherwise; the examples rewrite them there
        # to show the rewrites at work (their reference implementations: correct, not fast).
        fusenorm_inductor.config.cpu_reference = True
        print("CPU run: config.cpu_reference = True (fusenorm's rewrites run their reference implementations; "
              "without it a CPU graph compiles as plain Inductor's)")
    return device, getattr(torch, dtype or default)


@contextlib.contextmanager
def no_graph_caches():
    """Inductor's FX graph cache and AOTAutograd's cache off: every compile runs fusenorm's passes."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


_warmed_up = False


def warm_up_compiler(device: str) -> None:
    """Compile one tiny function first, once per process: Inductor starts its compile workers on the first
    compile, and their start-up would otherwise run beside the first model's timed steps."""
    global _warmed_up
    if _warmed_up:
        return
    _warmed_up = True
    with no_graph_caches():
        torch._dynamo.reset()
        torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="inductor", dynamic=False)(torch.ones(8, device=device))
        torch._dynamo.reset()


def compile_model(model: nn.Module, backend: str, reset: bool = True) -> nn.Module:
    """``torch.compile(model, backend=backend, dynamic=False)`` after a Dynamo reset (``reset=False``: keep
    what is compiled already, e.g. another model trained alongside); "eager": the model itself."""
    if reset:
        torch._dynamo.reset()
    if backend == "eager":
        return model
    import fusenorm_inductor

    if backend == "inductor" and fusenorm_inductor.config.enabled:  # FUSENORM_ENABLE=1: keep the baseline plain
        fusenorm_inductor.disable()
    if backend == "fusenorm":
        try:
            torch._dynamo.lookup_backend("fusenorm")
        except Exception:  # run from a checkout that is not pip-installed: no entry point, same backend
            backend = fusenorm_inductor.fusenorm_backend
    return torch.compile(model, backend=backend, dynamic=False)


def make_optimizer(model: nn.Module, lr: float, device: str) -> torch.optim.Optimizer:
    """AdamW, the same for every backend (fused on CUDA: the optimizer is not what is compared)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, fused=device == "cuda")


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch, loss_fn: Callable) -> torch.Tensor:
    """One training step (forward, backward, optimizer step, gradients cleared); returns the loss."""
    loss = loss_fn(model, batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def train(model: nn.Module, batches: Sequence, loss_fn: Callable, steps: int, lr: float, device: str
          ) -> tuple[list[float], list[float], float, Optional[float]]:
    """``steps`` training steps on ``batches`` (cycled); returns (losses, step times in ms, first step's wall
    time in s, compilation included, and on CUDA the peak memory of that first step in MiB). On CUDA the peak
    memory statistic is reset after the first step: what remains is the training steps' own peak (compile
    time holds more, e.g. fusenorm's tuner timing candidate kernels on tensors of the model's size)."""
    opt = make_optimizer(model, lr, device)
    cuda = device == "cuda"
    losses, times, events = [], [], []
    first_s, first_peak = float("nan"), None
    for step in range(steps):
        batch = batches[step % len(batches)]
        t0 = time.perf_counter()
        if cuda:
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
        loss = train_step(model, opt, batch, loss_fn)
        losses.append(loss.detach())
        if cuda:
            ev[1].record()
            events.append(ev)
        if step == 0 and cuda:
            torch.cuda.synchronize()
            first_peak = torch.cuda.max_memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
        if step == 0:
            first_s = time.perf_counter() - t0
        if not cuda:
            times.append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) for a, b in events]
    return torch.stack(losses).float().cpu().tolist(), times, first_s, first_peak


def run_backend(base: nn.Module, backend: str, batches: Sequence, loss_fn: Callable, steps: int, lr: float,
                device: str, dtype: torch.dtype, timed: int) -> dict:
    """Train a copy of ``base`` compiled with ``backend``: losses, step times, medians, peak memory, and (for
    fusenorm) the match reports of the graphs compiled."""
    import fusenorm_inductor

    model = copy.deepcopy(base).to(device=device, dtype=dtype)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seen = {id(r) for r in fusenorm_inductor.reports()}
    t0 = time.perf_counter()
    with no_graph_caches():
        compiled = compile_model(model, backend)
        losses, times, first_s, first_peak = train(compiled, batches, loss_fn, steps, lr, device)
    out = {
        "backend": backend,
        "losses": losses,
        "step_ms": times,
        "median_ms": median_tail(times, timed),
        "first_step_s": first_s,
        "wall_s": time.perf_counter() - t0,
        # The training steps' peak (after the first step: bench_models.py compares these), and the first's.
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" and steps > 1 else None,
        "first_step_peak_mib": first_peak,
    }
    if backend == "fusenorm":
        reports = [r for r in fusenorm_inductor.reports() if id(r) not in seen]
        out["reports"] = reports
        out["report"] = fusenorm_inductor.report.summarize(reports)
    del compiled, model
    torch._dynamo.reset()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def median_tail(times: Sequence[float], timed: int) -> float:
    """Median of the last ``timed`` step times (never the first step: it compiles)."""
    tail = list(times[1:])[-timed:] if len(times) > 1 else list(times)
    return statistics.median(tail) if tail else float("nan")


def compare(make_model: Callable[[], nn.Module], batches: Sequence, loss_fn: Callable, *, steps: int, lr: float,
            device: str, dtype: torch.dtype, seed: int = 0, timed: Optional[int] = None,
            backends: Iterable[str] = BACKENDS, log: Callable[[str], None] = print) -> dict:
    """The same model (built once under ``seed``) trained with each backend; returns {"runs": {backend:
    run_backend(...)}, "agreement": ``loss_agreement`` of the first two backends, "speedup": t_second / t_first,
    and with a third backend "eager", "noise_ref": eager against the second (the drift of two correct runs)}."""
    warm_up_compiler(device)
    torch.manual_seed(seed)
    base = make_model()
    timed = timed or max(1, steps // 2)
    runs: dict[str, Any] = {}
    for backend in backends:
        runs[backend] = run_backend(base, backend, batches, loss_fn, steps, lr, device, dtype, timed)
        r = runs[backend]
        log(f"  {backend:>8}: median step {r['median_ms']:.3f} ms (last {min(timed, steps - 1)} of {steps} steps), "
            f"first step {r['first_step_s']:.1f} s, final loss {r['losses'][-1]:.5f}"
            + (f", peak {r['peak_mib']:.0f} MiB" if r["peak_mib"] is not None else ""))
    names = list(runs)
    out = {"runs": runs, "steps": steps, "timed": timed, "device": device}
    if len(names) >= 2:
        a, b = runs[names[0]], runs[names[1]]
        out["agreement"] = loss_agreement(a["losses"], b["losses"], dtype)
        out["speedup"] = b["median_ms"] / a["median_ms"] if a["median_ms"] > 0 else float("nan")
        if "eager" in runs and "eager" not in names[:2]:  # how far two correct runs drift apart in this dtype
            out["noise_ref"] = loss_agreement(runs["eager"]["losses"], b["losses"], dtype)
    return out


def loss_agreement(a: Sequence[float], b: Sequence[float], dtype: torch.dtype, tail: Optional[int] = None) -> dict:
    """How close two loss curves are: max |a - b| over the run, the relative difference of the final losses,
    and ``tail_rel_diff``: the difference of the mean losses over the last ``tail`` steps (default: a tenth of
    the run, at least one) relative to max(|mean of b there|, |b[0]| / 10); "agree" when that is within
    ``LOSS_TOL[dtype]`` and every loss is finite. (The floor |b[0]| / 10 keeps a run that has driven its loss
    to ~0 from comparing rounding noise against ~0.)"""
    n = min(len(a), len(b))
    tail = tail or max(1, n // 10)
    diffs = [abs(x - y) for x, y in zip(a[:n], b[:n])]
    mean_a, mean_b = sum(a[n - tail:n]) / tail, sum(b[n - tail:n]) / tail
    finite = all(math.isfinite(x) for x in list(a[:n]) + list(b[:n]))
    scale = max(abs(mean_b), abs(b[0]) / 10 if n else 0.0, 1e-12)
    rel_tail = abs(mean_a - mean_b) / scale
    tol = LOSS_TOL.get(dtype, LOSS_TOL[torch.bfloat16])
    return {
        "max_abs_diff": max(diffs) if diffs else float("nan"),
        "final_rel_diff": abs(a[n - 1] - b[n - 1]) / max(abs(b[n - 1]), 1e-12) if n else float("nan"),
        "tail_steps": tail,
        "tail_rel_diff": rel_tail,
        "tol": tol,
        "agree": bool(finite and rel_tail <= tol),
        "first_loss": b[0] if n else None,
        "last_loss": b[n - 1] if n else None,
    }


# ----------------------------------------------------------------------------------------------------------
# The match report: which norm sites were fused, which not and why
# ----------------------------------------------------------------------------------------------------------

def print_report(run: dict, mode: str = "full") -> None:
    """Print a fusenorm run's match report: "full" (every graph's markdown), "summary" or "none"."""
    if mode == "none" or "report" not in run:
        return
    if not run["reports"]:
        print("(no match report: nothing was compiled by fusenorm's passes, e.g. a graph-cache hit)")
        return
    if mode == "full":
        for rep in run["reports"]:
            print(rep.to_markdown())
    from fusenorm_inductor.report import format_summary

    print(format_summary(run["report"]))


def print_losses(result: dict, every: Optional[int] = None) -> None:
    names = list(result["runs"])
    losses = [result["runs"][n]["losses"] for n in names]
    steps = len(losses[0])
    every = every or max(1, steps // 10)
    print(f"{'step':>5} " + " ".join(f"{'loss ' + n:>14}" for n in names))
    for i in range(steps):
        if i % every == 0 or i == steps - 1:
            print(f"{i:5d} " + " ".join(f"{ls[i]:14.6f}" for ls in losses))
    ref = result.get("noise_ref")
    if ref:
        print(f"noise reference (eager vs {names[1]}): {_diffs(ref)}")
    agr = result.get("agreement")
    if agr:
        print(f"loss agreement: {_diffs(agr)} (tol {agr['tol']:g}): {'agree' if agr['agree'] else 'DO NOT AGREE'}")


def _diffs(d: dict) -> str:
    """One line of a loss comparison's differences (``agreement`` or ``noise_ref``)."""
    return (f"max |diff| {d['max_abs_diff']:.3g}, final rel diff {d['final_rel_diff']:.3g}, "
            f"mean of last {d['tail_steps']} steps: rel diff {d['tail_rel_diff']:.3g}")


def print_times(result: dict, device: str) -> None:
    runs = result["runs"]
    parts = ", ".join(f"{n} {r['median_ms']:.3f} ms" for n, r in runs.items())
    clock = "CUDA events" if device == "cuda" else "wall clock, CPU: not a performance number"
    speed = f", speedup {result['speedup']:.3f}x" if "speedup" in result else ""
    print(f"median step time ({clock}, last {result['timed']} steps): {parts}{speed}")


# ----------------------------------------------------------------------------------------------------------
# Output: JSON and plots
# ----------------------------------------------------------------------------------------------------------


def jsonable(result: dict) -> dict:
    """A comparison without the report objects (their summary stays), floats rounded, no NaN/inf."""
    def clean(x):
        if isinstance(x, float):
            return float(f"{x:.6g}") if math.isfinite(x) else None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if k != "reports"}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return clean(result)


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(jsonable(data), f, indent=1)
    os.replace(tmp, path)
    print(f"wrote {path}")


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a note) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    return plt


def plot_panels(axes, title: str, result: dict) -> None:
    """Left: loss curves of every backend, and |difference| of the first two on a right-hand axis. Right: step
    times (the first step, which compiles, left out; the timed window shaded)."""
    ax_loss, ax_t = axes
    runs = result["runs"]
    for name, run in runs.items():
        ax_loss.plot(run["losses"], label=name, lw=1)
        ts = run["step_ms"][1:]
        ax_t.plot(range(1, len(ts) + 1), ts, label=f"{name}: median {run['median_ms']:.3g} ms", lw=0.8)
    names = list(runs)
    if len(names) >= 2:
        a, b = runs[names[0]]["losses"], runs[names[1]]["losses"]
        ax_d = ax_loss.twinx()
        ax_d.plot([abs(x - y) for x, y in zip(a, b)], color="grey", lw=0.6, ls=":", label="|difference|")
        ax_d.set_ylim(bottom=0)
        ax_d.tick_params(labelsize=6, colors="grey")
        ax_d.set_ylabel("|difference|", fontsize=6, color="grey")
    steps = max(len(r["step_ms"]) for r in runs.values())
    timed = result.get("timed")
    if timed and steps > 1:
        ax_t.axvspan(max(1, steps - timed), steps - 1, color="0.9", label=f"timed: last {timed} steps")
        medians = [r["median_ms"] for r in runs.values() if math.isfinite(r["median_ms"])]
        if medians:
            ax_t.set_ylim(0, 2.5 * max(medians))  # compile-time stragglers off the scale
    agr = result.get("agreement", {})
    ax_loss.set_title(f"{title}: loss" + (f" (final rel diff {agr['final_rel_diff']:.2g})" if agr else ""),
                      fontsize=8)
    ax_loss.set_xlabel("step", fontsize=7)
    speed = f" (speedup {result['speedup']:.3f}x)" if result.get("speedup") else ""
    if speed and result.get("device") == "cpu":
        speed = f" (CPU wall clock, not a performance number: {result['speedup']:.3f}x)"
    ax_t.set_title(f"{title}: step time, ms{speed}", fontsize=8)
    ax_t.set_xlabel("step", fontsize=7)
    for ax in axes:
        ax.legend(fontsize=6)
        ax.tick_params(labelsize=6)


def plot_results(results: dict[str, dict], path: str, suptitle: str = "") -> None:
    """One row per comparison (name -> ``compare`` result): loss curves left, step times right."""
    plt = pyplot()
    if plt is None or not results:
        return
    fig, axes = plt.subplots(len(results), 2, figsize=(11, 2.6 * len(results)), squeeze=False)
    for row, (name, result) in zip(axes, results.items()):
        plot_panels(row, name, result)
    if suptitle:
        fig.suptitle(suptitle, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def finish(name: str, result: dict, args, device: str, dtype: torch.dtype, config: dict) -> dict:
    """What every example prints and writes at the end: report, losses, times, --json, --plot."""
    print_report(result["runs"].get("fusenorm", {}), getattr(args, "report", "full"))
    print(f"{name}: {config}, {str(dtype).replace('torch.', '')}, {device}")
    print_losses(result)
    print_times(result, device)
    if getattr(args, "json", None):
        write_json(args.json, {"model": name, "config": config, "device": device,
                               "dtype": str(dtype).replace("torch.", ""), **result})
    if getattr(args, "plot", None):
        plot_results({name: result}, args.plot, f"{name}, {device}, {str(dtype).replace('torch.', '')}")
    return result


def make_parser(doc: str) -> argparse.ArgumentParser:
    """An example's parser: its docstring's first paragraph as the description, the rest kept as written."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_common_args(p, steps_cpu: int, steps_cuda: int, lr: float, report: str) -> None:
    """--batches, --steps, --timed, --lr, --device, --dtype, --seed, --plot, --json, --report, --backends
    (``lr`` and ``report``: the example's defaults)."""
    cuda = torch.cuda.is_available()
    p.add_argument("--batches", type=int, default=4, help="distinct batches, cycled")
    p.add_argument("--steps", type=int, default=steps_cuda if cuda else steps_cpu)
    p.add_argument("--timed", type=int, default=None,
                   help="step times: median of the last TIMED steps (default: half the run, at most 50)")
    p.add_argument("--lr", type=float, default=lr, help="AdamW learning rate")
    p.add_argument("--device", default=None, choices=["cuda", "cpu"],
                   help="default: cuda where a GPU is present (the size defaults are for it), else cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="PNG", help="write the loss curves and step times (needs matplotlib)")
    p.add_argument("--json", metavar="PATH", help="write losses, step times, agreement and the report summary")
    p.add_argument("--report", choices=["full", "summary", "none"], default=report,
                   help="how much of fusenorm's match report to print")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help="comma list of backends to compare (fusenorm, inductor, eager); the first two are compared")


def timed_steps(args) -> int:
    return args.timed or max(1, min(50, args.steps // 2))
