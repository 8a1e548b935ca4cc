"""The benchmarks' shared harness: timers, alternating rounds, peak memory, the environment stamp, JSON and PNG.

Every bench_*.py and every probe under probes/ takes its timing from here, so that "t_*_ms" means the same thing
wherever it is written. Timers (each returns milliseconds per call):

    do_bench_ms(fn, rep, warmup)  ``triton.testing.do_bench`` median: CUDA events around plain calls, so the
                                  CPU's launch cost counts wherever the GPU waits for it (``--timer events``)
    cudagraph_ms(fn, rep)         ``triton.testing.do_bench_cudagraph`` median: the calls captured in a CUDA graph
                                  and replayed, GPU time alone (``--timer cudagraph``)
    events_ms(fn, calls)          CUDA events around ``calls`` back-to-back calls, no host sync inside: a step
                                  time in which the host cost counts (whole training steps)
    wall_ms(fn, calls)            median wall clock of ``calls`` calls: the CPU (dry runs; meaningless as speed)
    host_us(fn, calls)            wall time per call of a loop of calls, synchronized at both ends, in µs: what
                                  a call costs the CPU while the GPU idles (tiny inputs)
    profile_kernels(fn, iters)    torch.profiler: mean CUDA time per call of ``fn`` by kernel name

``Bench`` picks do_bench_ms or cudagraph_ms by name (and wall_ms on the CPU), falls back to do_bench when a call
cannot be captured, and measures a call's peak memory. Rounds: ``alternating`` times several candidates in turn,
round after round (optionally rotating the order each round), with a synchronous timer; ``event_rounds`` does the
same with CUDA events around single calls and one sync at the end. ``medians``, ``ratio_median`` (the median of
per-round ratios) and ``spread`` (max / min - 1, the A/A noise of repeated runs of the same code) summarize them.
Peak memory: ``peak_mib(fn)`` for one call, ``PeakMemory`` around a block. Compiled models: ``own_code`` gives a
model's forward its own code object (an independent compile beside another instance of its class),
``fused_patterns`` reads fusenorm's match reports ("deferred_norm x3"). ``environment()`` is the meta block's
stamp (GPU, torch, triton, python, date, commit). ``write_json`` writes atomically, ``pyplot()`` imports matplotlib
lazily (None and a note where it is missing), ``merge`` joins the rows of partial runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import time
import types
from collections import Counter
from collections.abc import Callable, Iterable

import torch

# ----------------------------------------------------------------------------------------------------------
# Timers: milliseconds per call (host_us: microseconds)
# ----------------------------------------------------------------------------------------------------------


def sync() -> None:
    """Wait for the GPU, where there is one (a no-op on CPU-only machines: the dry runs)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def do_bench_ms(fn: Callable, rep: float = 100, warmup: float = 25) -> float:
    """``triton.testing.do_bench`` median (ms): plain calls between CUDA events, launch overhead included."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def cudagraph_ms(fn: Callable, rep: float = 20) -> float:
    """``triton.testing.do_bench_cudagraph`` median (ms): replays of a captured CUDA graph, GPU time alone. Note
    that do_bench_cudagraph replays a graph of ~rep ms about 10 times (``Bench`` passes rep_ms / 10)."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=rep, return_mode="median")


def events_ms(fn: Callable, calls: int = 1) -> float:
    """Time per call of ``calls`` back-to-back calls between two CUDA events (no sync inside: the host cost
    counts where the GPU waits for it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def wall_ms(fn: Callable, calls: int = 3) -> float:
    """Median wall-clock time of ``calls`` single calls (ms): the CPU stand-in of the dry runs."""
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def host_us(fn: Callable, calls: int = 1000) -> float:
    """Wall time per call (µs) of a loop of ``calls`` calls, synchronized at the end: on tiny inputs, with the
    GPU idle, what one call costs the CPU."""
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def profile_kernels(fn: Callable, iters: int) -> dict:
    """Mean CUDA time per call of ``fn`` by kernel name (ms, names cut at 90 characters), from torch.profiler,
    largest first; one untimed call first."""
    import collections

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name[:90]] += e.device_time / 1e3 / iters
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# ----------------------------------------------------------------------------------------------------------
# Peak memory
# ----------------------------------------------------------------------------------------------------------


def peak_mib(fn: Callable) -> float | None:
    """Memory allocated by one call of ``fn`` above what was allocated before it (its outputs included), MiB;
    None off CUDA."""
    if not torch.cuda.is_available():
        return None
    with PeakMemory() as pm:
        out = fn()
    del out
    return pm.mib


class PeakMemory:
    """``torch.cuda.max_memory_allocated`` over a block, the peak statistics reset on entry: ``mib`` is the peak
    above what was allocated on entry (``relative``, the default) or the absolute peak; None off CUDA.

        with PeakMemory() as pm:
            ...
        pm.mib
    """

    def __init__(self, relative: bool = True):
        self.relative, self.mib, self._base = relative, None, 0

    def __enter__(self) -> "PeakMemory":
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated() if self.relative else 0
        return self

    def __exit__(self, *exc) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self.mib = (torch.cuda.max_memory_allocated() - self._base) / 2**20


# ----------------------------------------------------------------------------------------------------------
# Bench: a timer chosen by name, its fallback, and a call's peak memory
# ----------------------------------------------------------------------------------------------------------


def backtoback_ms(fn: Callable, rep: float = 100, parts: int = 5) -> float:
    """Median over ``parts`` of events_ms of back-to-back calls, about ``rep`` ms of them in all after one call to
    size them: no L2 flush and no gap between calls, as a serving or training loop runs (do_bench flushes the L2
    and leaves a gap before each call, which on the H200 flattered some kernels against others:
    docs/history/performance-log.md, "Deferred normalization")."""
    fn()
    one = events_ms(fn, 1)
    calls = max(2, int(rep / parts / max(one, 1e-3)))
    return statistics.median(events_ms(fn, calls) for _ in range(parts))


class Bench:
    """Times callables with the chosen timer (``"cudagraph"``: cudagraph_ms with rep = rep_ms / 10, which keeps
    one timing at ~rep_ms of GPU time; ``"events"``: do_bench_ms with rep = rep_ms, warmup = rep_ms / 4;
    ``"backtoback"``: backtoback_ms with rep = rep_ms) and reads their peak memory. On the CPU (``device`` not
    "cuda", the dry runs) it takes wall_ms of 3 calls: that exercises the code and measures nothing of interest.
    ``rounds``: how many alternating rounds a benchmark runs with it (bench_gemm_norm)."""

    def __init__(self, timer: str, rep_ms: float, device: str, rounds: int = 1):
        self.timer, self.rep_ms, self.cuda, self.rounds = timer, rep_ms, device == "cuda", rounds

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time_ms(self, fn: Callable) -> tuple[float, str | None]:
        """(median ms, note): the note says when the CUDA-graph timer failed and do_bench was used."""
        if not self.cuda:
            return wall_ms(fn, 3), None
        note = None
        if self.timer == "cudagraph":
            try:
                return cudagraph_ms(fn, rep=max(1.0, self.rep_ms / 10)), None
            except Exception as e:  # noqa: BLE001 (e.g. a call that cannot be captured: time it anyway, say so)
                note = f"cudagraph failed ({type(e).__name__}: {str(e)[:120]}), timed with do_bench"
                torch.cuda.synchronize()
        if self.timer == "backtoback":
            return backtoback_ms(fn, rep=self.rep_ms), None
        return do_bench_ms(fn, rep=self.rep_ms, warmup=max(1.0, self.rep_ms / 4)), note

    def ms(self, fn: Callable) -> float:
        """time_ms without the note (the timer for ``alternating``)."""
        return self.time_ms(fn)[0]

    def peak_mib(self, fn: Callable) -> float | None:
        """peak_mib(fn) on CUDA, None on the CPU."""
        return peak_mib(fn) if self.cuda else None

    def measure(self, fn: Callable) -> dict:
        """{"ms", "peak_mib", "out", "note"}; the first call compiles / autotunes and its output is kept for
        the numerics check."""
        out = fn()
        self.sync()
        peak = self.peak_mib(fn)
        ms, note = self.time_ms(fn)
        return {"ms": ms, "peak_mib": peak, "out": out, "note": note}


# ----------------------------------------------------------------------------------------------------------
# Rounds of several candidates, and what summarizes them
# ----------------------------------------------------------------------------------------------------------


def rotated(names: list | tuple, i: int) -> list:
    """``names`` in the order of round ``i`` when the order rotates by one per round."""
    names = list(names)
    k = i % len(names) if names else 0
    return names[k:] + names[:k]


def alternating(fns: dict, timer: Callable[[Callable], float], rounds: int, rotate: bool = False,
                warmup: int = 0) -> dict[str, list[float]]:
    """``rounds`` rounds of ``timer(fn)`` for every candidate of ``fns`` (name -> callable), the candidates in
    turn within each round (A, B, A', ...; with ``rotate`` the order rotates by one per round), so that a slow
    drift of clock, temperature or host speed hits them all alike. ``warmup`` untimed calls of each first (then a
    sync). Returns name -> the times of its rounds, in round order."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    if warmup:
        sync()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(rounds):
        for name in (rotated(fns, i) if rotate else fns):
            times[name].append(timer(fns[name]))
    return times


def event_rounds(names: tuple, run: Callable[[str, int], object], rounds: int, cuda: bool,
                 rotate: bool = True) -> dict[str, list[float]]:
    """``rounds`` rounds of ``run(name, i)`` for each name, the order rotating by one per round (``rotate``); per
    name its times in ms: CUDA events around each call with no host sync inside the loop (one sync at the end),
    wall clock on the CPU."""
    walls: dict = {b: [] for b in names}
    events: dict = {b: [] for b in names}
    for i in range(rounds):
        for b in (rotated(names, i) if rotate else names):
            t0 = time.perf_counter()
            if cuda:
                ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                ev[0].record()
            run(b, i)
            if cuda:
                ev[1].record()
                events[b].append(ev)
            else:
                walls[b].append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize()
        walls = {b: [a.elapsed_time(e) for a, e in evs] for b, evs in events.items()}
    return walls


def medians(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(ts) for name, ts in times.items()}


def ratio_median(times: dict[str, list[float]], num: str, den: str) -> float:
    """The median over the rounds of times[num] / times[den] of the same round (a speedup when num is the
    baseline; the A/A ratio when both are the same code)."""
    return statistics.median(a / b for a, b in zip(times[num], times[den]))


def spread(values: Iterable[float]) -> float | None:
    """max / min - 1 of repeated measurements of the same code (the A/A noise); None when one is not positive."""
    values = list(values)
    return max(values) / min(values) - 1.0 if values and min(values) > 0 else None


# ----------------------------------------------------------------------------------------------------------
# Compiled models: independent compiles, what fusenorm fused
# ----------------------------------------------------------------------------------------------------------


def own_code(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with a forward of its own code object. Dynamo caches compiled frames per code object, and
    another instance of the same class passes the guards of the first one's entry: without this, an A/A
    model would run the first Inductor compile's code instead of being compiled independently."""
    f = type(model).forward
    g = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    g.__kwdefaults__ = f.__kwdefaults__  # keyword-only defaults (the HF models' forwards have them)
    model.forward = types.MethodType(g, model)
    return model


def fused_patterns(reps: list, pattern: str = "deferred_norm") -> dict:
    """What a fusenorm compile's match reports say: the patterns that rewrote something (canonicalizations left
    out), ``fused`` as "pattern xN, ..." or "none", why ``pattern`` did not fire where it was looked at
    (``deferred_reasons``), what its rewrites decided and made (``deferred_rewrites``: the measured times,
    whether the backward was deferred), the other patterns' skips and the errors."""
    rewrites = Counter(r.pattern for rep in reps for r in rep.rewrites if not r.pattern.startswith("canonical"))
    skips = [s for rep in reps for s in rep.skips]
    return {
        "fused": ", ".join(f"{p} x{n}" for p, n in sorted(rewrites.items())) or "none",
        "fusenorm_rewrites": dict(rewrites),
        "deferred_rewrites": [f"{r.kernel} | {r.detail}"[:600] for rep in reps for r in rep.rewrites
                              if r.pattern == pattern],
        "deferred_reasons": sorted({s.reason[:300] for s in skips if s.pattern == pattern}),
        "fusenorm_skips": [f"{s.pattern} at {s.node}: {s.reason}"[:300] for s in skips if s.pattern != pattern],
        "fusenorm_errors": [e[:300] for rep in reps for e in rep.errors],
    }


# ----------------------------------------------------------------------------------------------------------
# Environment stamp
# ----------------------------------------------------------------------------------------------------------


def gpu_name(device: str = "cuda") -> str:
    return torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.processor() or '?'})"


def git_commit() -> str | None:
    """HEAD of the checkout (+dirty with local changes), None where git is missing."""
    def git(*cmd):
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", *cmd], cwd=here, capture_output=True, text=True, timeout=10, check=True)

    try:
        return git("rev-parse", "HEAD").stdout.strip() + ("+dirty" if git("status", "--porcelain").stdout else "")
    except (OSError, subprocess.SubprocessError):
        return None


def quack_versions() -> str:
    """quack's and the CUTLASS DSL's versions ("quack X, nvidia-cutlass-dsl Y"), or "not installed"."""
    from importlib import metadata

    try:
        return f"quack {metadata.version('quack-kernels')}, nvidia-cutlass-dsl {metadata.version('nvidia-cutlass-dsl')}"
    except metadata.PackageNotFoundError:
        try:
            import quack

            return f"quack {getattr(quack, '__version__', '?')} (no package metadata)"
        except Exception:  # noqa: BLE001 - not importable
            return "not installed"


def environment(device: str = "cuda", *, python: bool = True, commit: bool = True, date: str = "seconds") -> dict:
    """The meta block's stamp, in this order: gpu (or "cpu (...)"), torch, triton, python (unless python=False),
    date (``"seconds"``: ISO date and time; ``"day"``: ISO date), commit (unless commit=False)."""
    import triton

    out = {"gpu": gpu_name(device), "torch": torch.__version__, "triton": triton.__version__,
           "quack": quack_versions()}
    if python:
        out["python"] = platform.python_version()
    out["date"] = (datetime.datetime.now().isoformat(timespec="seconds") if date == "seconds"
                   else datetime.date.today().isoformat())
    if commit:
        out["commit"] = git_commit()
    return out


# ----------------------------------------------------------------------------------------------------------
# Output: JSON, PNG, merging partial runs
# ----------------------------------------------------------------------------------------------------------


def _rounded(x):
    """JSON-friendly: 6 significant digits, no NaN/inf (JSON has none)."""
    if isinstance(x, float):
        return float(f"{x:.6g}") if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


def write_json(path: str, data: dict, quiet: bool = False, rounded: bool = True) -> None:
    """Write ``data`` (floats to 6 significant digits, NaN/inf as null, unless ``rounded`` is False) atomically: a
    run killed while writing leaves the previous file whole. Prints "wrote PATH" unless ``quiet``."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(_rounded(data) if rounded else data, f, indent=1)
    os.replace(tmp, path)
    if not quiet:
        print(f"wrote {path}")


def read_rows(path: str, key: Callable[[dict], tuple], keep: Callable[[dict], bool] = lambda r: True) -> dict:
    """The rows of a JSON written by a benchmark that ``keep`` accepts, by ``key(row)`` ({} when the file is
    missing): what ``--resume`` leaves alone."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {key(r): r for r in json.load(f)["rows"] if keep(r)}


def merge(paths: list[str], key: Callable[[dict], tuple]) -> dict:
    """Rows of partial runs concatenated (a row measured twice, by ``key(row)``: the later file wins), meta from
    the first with ``merged_from`` listing the sources (a file that is itself a merge contributes its own)."""
    datas = []
    for path in paths:
        with open(path) as f:
            datas.append(json.load(f))
    rows: dict[tuple, dict] = {}
    dups = 0
    for data in datas:
        for r in data["rows"]:
            k = key(r)
            dups += k in rows
            rows[k] = r
    if dups:
        print(f"note: {dups} points are in several files; the last file's rows were kept")
    meta = dict(datas[0]["meta"])
    meta.pop("partial", None)
    meta["merged_from"] = [src for p, d in zip(paths, datas) for src in d["meta"].get("merged_from") or
                           [{"file": p, "date": d["meta"].get("date"), "commit": d["meta"].get("commit"),
                             "ceilings": d["meta"].get("ceilings")}]]
    return {"meta": meta, "rows": list(rows.values())}


def png_path(json_path: str) -> str:
    return os.path.splitext(json_path)[0] + ".png"


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (and a note) where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed: no PNG (install it, then rerun with --plot-only JSON)")
        return None
    return plt


def save_figure(fig, path: str, dpi: int, **kwargs) -> None:
    """Save and close a matplotlib figure, print "wrote PATH"."""
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=dpi, **kwargs)
    plt.close(fig)
    print(f"wrote {path}")


# ----------------------------------------------------------------------------------------------------------
# Command lines
# ----------------------------------------------------------------------------------------------------------


def choices(p: argparse.ArgumentParser, flag: str, value: str, allowed: tuple) -> list[str]:
    """A comma list whose items must be in ``allowed`` (argparse error otherwise)."""
    items = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        p.error(f"{flag}: {bad or value!r} not in {allowed}")
    return items


def doc_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose description is the first paragraph of a script's docstring, its epilog the rest."""
    head, _, rest = doc.partition("\n\n")
    return argparse.ArgumentParser(description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter)


def kernel_probe_args(doc: str, argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of the kernel probes run under Nsight Compute (probes/probe_bwd_epilogue.py,
    probes/probe_norm_mm_gluon.py): one point (K, N, norm), one configuration by its label, M rows, iterations for a
    profiler, or ``--time``. The parser's description is the first paragraph of ``doc``, its epilog the rest."""
    p = doc_parser(doc)
    p.add_argument("--K", type=int, required=True)
    p.add_argument("--N", type=int, required=True)
    p.add_argument("--norm", choices=["layer", "rms"], required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--rows", type=int, default=262144)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--time", action="store_true")
    return p.parse_args(argv)
