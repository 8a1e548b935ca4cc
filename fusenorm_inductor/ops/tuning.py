"""Per-shape kernel choice and the fuse-or-not decision for the fused GEMM + norm ops, from measurements.

Two questions, both answered by timing on the GPU once per shape and remembered across processes:

1. Which configuration of the fused kernel runs (``forward_config`` / ``backward_config``, called by the
   launchers on every call): the kernels' candidate list (``forward_candidates`` in mm_norm_kernels.py, ...)
   is short (2-4 entries), each is timed with CUDA graphs on random inputs of the call's shape, the fastest
   is kept. Without CUDA, with tuning off, or while a CUDA graph is being captured, the first candidate
   (the kernels' best guess) runs and nothing is cached.
2. Whether to fuse at all (``forward_choice`` / ``backward_choice``, called by the patterns at compile time):
   the best fused time against the unfused path's time, estimated as cuBLAS's GEMM plus a norm at copy
   speed (Inductor's norm kernels run at the copy bandwidth: docs/baselines-h200.md), so the estimate is what
   plain Inductor does. Fusion is kept only when it is faster by ``config.tuning.margin``; otherwise the
   match report names the measured times and Inductor compiles the graph as it would without fusenorm.

Deterministic mode (``torch.use_deterministic_algorithms(True)``): nothing is timed and the cache is not
read, since timings (and so the choices made from them) differ from run to run. Every launch runs the
kernels' first candidate, and every match is fused, as with ``config.tuning.measure`` off; the match
report's reason says so.

The cache is a JSON file (``config.tuning.cache_dir``, default ``~/.cache/fusenorm``) keyed by the GPU,
torch and triton versions, a hash of the kernel sources, the shape, dtypes and flags. Entries are merged on
write, so concurrent processes only ever lose each other's newest entries, never corrupt the file.
Nothing about the cache fails a compile or a launch: a file that cannot be parsed or is not a JSON object,
and an entry of the wrong shape, count as absent (that shape is measured again, or runs the first candidate
where it cannot be), and a cache directory that cannot be written keeps measurements in the process only;
either warns once per file or directory, naming it.

The unfused norm's time needs the copy bandwidth, probed once per device and process
(``copy_bandwidth_gbps``). When the probe fails (it warns once; a failure is not remembered, so a later
call probes again), the launchers still run the fastest measured configuration, but the fuse decision counts
as not measured: the match is fused, as with ``config.tuning.measure`` off, and the reason says why. Such an
entry is kept in the process only, never written to the cache.

The choice functions take the ops' own arguments but read only shapes, dtypes, strides, devices and which
optionals are present, so fake tensors from a traced graph work.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

from .. import config

__all__ = [
    "Choice",
    "backward_choice",
    "backward_config",
    "clear_memory",
    "copy_bandwidth_gbps",
    "forward_choice",
    "forward_config",
    "forward_out_bytes",
]

CACHE_VERSION = 1
_memo: dict[tuple, dict] = {}  # in-process cache: key -> entry (as stored on disk)
_misses: set[tuple] = set()  # keys the disk cache did not have (read the file once per key, not per call)
_warned: set[tuple] = set()  # what was warned about already (a cache file, a cache directory, a probed device)


@dataclass(frozen=True)
class Choice:
    fuse: bool
    config: str  # the fused kernel's configuration label ("ptr ...", "row ...", "coop ...")
    reason: str
    t_fused_ms: Optional[float] = None
    t_unfused_ms: Optional[float] = None


def clear_memory() -> None:
    """Forget in-process results and which problems were warned about (the disk cache stays); tests use it."""
    _memo.clear()
    _misses.clear()
    _warned.clear()


def _warn_once(what: tuple, msg: str) -> None:
    """``warnings.warn`` (as the passes do), once per ``what`` and process."""
    if what not in _warned:
        _warned.add(what)
        warnings.warn(f"fusenorm: {msg}", stacklevel=3)


# ----------------------------------------------------------------------------------------------------------
# Keys and the disk cache
# ----------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _sources_hash() -> str:
    here = Path(__file__).parent
    h = hashlib.sha256()
    kernels = ("_triton_common.py", "mm_norm_kernels.py", "mm_norm_backward_kernels.py", "norm_mm_kernels.py")
    for name in (*kernels, "tuning.py"):
        h.update((here / name).read_bytes())
    for path in sorted((here.parent / "kernels").rglob("*.py")):  # the Gluon kernels
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _device_tag(device: torch.device) -> str:
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{name}|torch {torch.__version__}|triton {triton.__version__}"


def _cache_file() -> Path:
    root = config.tuning.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "fusenorm")
    return Path(root) / f"tuning-v{CACHE_VERSION}.json"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _warn_file(path: Path, problem: str) -> None:
    _warn_once(("read", str(path)), f"tuning cache {path}: {problem}; ignored (those shapes are measured again)")


def _read_disk() -> dict:
    """The cache file's entries; {} when there is none, or (warned once per file) when it cannot be read, is
    not JSON or is not a JSON object. Entries are not checked here (``_lookup`` does, on use)."""
    path = _cache_file()
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):  # nothing measured yet (a cache_dir that is a file: on write)
        return {}
    except (OSError, ValueError) as e:  # unreadable, or not UTF-8
        _warn_file(path, f"cannot be read ({_first_line(e)})")
        return {}
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        _warn_file(path, f"not valid JSON ({_first_line(e)})")
        return {}
    if not isinstance(data, dict):
        _warn_file(path, f"not a JSON object but {type(data).__name__}")
        return {}
    return data


def _write_disk(key: str, entry: dict) -> None:
    path = _cache_file()
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_disk()  # a malformed file (warned) is replaced by one holding this entry
        data[key] = entry
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tuning-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=0, sort_keys=True)
        os.replace(tmp, path)  # atomic: readers see the old or the new file, never half of one
        tmp = None
    except (OSError, TypeError, ValueError) as e:
        # An unwritable cache only costs re-measuring in the next process.
        _warn_once(("write", str(path.parent)),
                   f"cannot write the tuning cache in {path.parent} ({_first_line(e)}); measurements are kept in "
                   f"this process only")
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _entry_problem(entry) -> Optional[str]:
    """What is wrong with a cache entry read from disk, None if nothing (``_choice`` and ``_tuned_config``
    read its config and its two times)."""
    if not isinstance(entry, dict):
        return f"an entry is {type(entry).__name__}, not an object"
    for name in ("t_fused_ms", "t_unfused_ms"):
        t = entry.get(name)
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0:  # inf is fine, NaN is not
            return f"an entry's {name!r} is {t!r}, not a time in ms"
    try:
        _config_of(entry)
    except ValueError as e:
        return f"an entry's 'config' {e}"
    return None


def _lookup(key: tuple) -> Optional[dict]:
    """The entry for key: this process's, else the disk cache's (a malformed one counts as absent), else None."""
    if key in _memo:
        return _memo[key]
    if key in _misses:
        return None
    data, disk_key = _read_disk(), _disk_key(key)
    entry = data.get(disk_key)
    if disk_key in data:
        problem = _entry_problem(entry)
        if problem is not None:
            _warn_file(_cache_file(), problem)
            entry = None
    if entry is None:
        _misses.add(key)
    else:
        _memo[key] = entry
    return entry


def _store(key: tuple, entry: dict) -> None:
    _memo[key] = entry
    _misses.discard(key)
    if entry.get("t_unfused_ms") is not None:  # without it (a failed bandwidth probe) it stays in this process
        _write_disk(_disk_key(key), entry)


def _disk_key(key: tuple) -> str:
    return json.dumps([_device_tag(key[1]), _sources_hash(), key[0], *key[2:]], default=str)


def _spec(t: Optional[Tensor]):
    """What of an argument decides the kernel and its speed (None stays None)."""
    if t is None:
        return None
    return (tuple(t.shape), tuple(t.stride()), str(t.dtype))


# ----------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------


def _can_measure(device: torch.device) -> bool:
    return device.type == "cuda" and config.tuning.measure and not torch.cuda.is_current_stream_capturing()


def _time_ms(fn: Callable[[], object]) -> float:
    """Median GPU time of fn in a CUDA graph (leaves out the CPU launch cost, which a training step
    overlaps with earlier kernels); inf when fn fails (e.g. a config that does not fit shared memory)."""
    from triton.testing import do_bench_cudagraph

    try:
        fn()
        torch.cuda.synchronize()
        return float(do_bench_cudagraph(fn, rep=config.tuning.rep_ms, return_mode="median"))
    except Exception:  # noqa: BLE001 - a failing candidate is simply not chosen
        torch.cuda.synchronize()
        return float("inf")


class _RealInputs:
    """Random tensors like the given (possibly fake) ones, made outside any fake/functional mode."""

    def __enter__(self):
        from torch.utils._python_dispatch import _disable_current_modes

        self._modes = _disable_current_modes()
        self._modes.__enter__()
        self._grad = torch.no_grad()
        self._grad.__enter__()
        return self

    def __exit__(self, *exc):
        self._grad.__exit__(*exc)
        self._modes.__exit__(*exc)

    @staticmethod
    def like(t: Optional[Tensor], device: torch.device, scale: float = 1.0) -> Optional[Tensor]:
        if t is None:
            return None
        if t.numel() == 0:
            return torch.empty(tuple(t.shape), dtype=t.dtype, device=device)
        # Same strides as the original (a transposed weight stays transposed). A private generator: tuning
        # at compile time must not move the user's random streams.
        gen = torch.Generator(device=device).manual_seed(0)
        base = torch.randn(t.shape, dtype=torch.float32, device=device, generator=gen) * scale
        out = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
        return out.copy_(base)


def _gemm_ms(a: Tensor, b: Tensor, bias: Optional[Tensor]) -> float:
    """cuBLAS's time for the unfused graph's linear: addmm with a bias, else mm."""
    return _time_ms((lambda: torch.addmm(bias, a, b)) if bias is not None else (lambda: torch.mm(a, b)))


def _norm_proxy_ms(m: int, n: int, dtype: torch.dtype, passes: int, device: torch.device) -> Optional[float]:
    """The unfused norm's time, taken as ``passes`` streams of [m, n] elements at the copy bandwidth:
    Inductor's norm kernels reach it on these shapes (docs/baselines-h200.md). (torch's own ``copy_`` does not:
    ~2.7 of ~4.2 TB/s on the H200, which would make the unfused path look slower than it is.) None when the
    bandwidth probe failed."""
    gbps = copy_bandwidth_gbps(device)
    if not gbps > 0:
        return None
    itemsize = torch.empty((), dtype=dtype).element_size()
    return passes * m * n * itemsize / (gbps * 1e6)


def _plus(t_mm: float, t_norm: Optional[float]) -> Optional[float]:
    """The unfused path's time; None (not measured) without the norm's."""
    return None if t_norm is None else t_mm + t_norm


@functools.cache
def _copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, numel, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    return copy


def copy_bandwidth_gbps(device: torch.device) -> float:
    """Streaming bandwidth (read + write) of a wide Triton copy of 1 GiB, GB/s; measured once per device
    and process (also the benchmark's bandwidth ceiling). 0.0 when the probe fails (the copy does not run,
    or 1 GiB is not free): that warns once per device and is not remembered, so the next call probes again."""
    key = ("copy_gbps", device)
    if key in _memo:
        return _memo[key]["gbps"]
    numel = 1 << 29
    ms, err = math.inf, "the timed copy kernel failed"
    try:
        import triton

        with _RealInputs():
            src = torch.empty(numel, dtype=torch.bfloat16, device=device)
            dst = torch.empty_like(src)
            block = 8192
            kernel = _copy_kernel()
            ms = _time_ms(lambda: kernel[(triton.cdiv(numel, block),)](src, dst, numel, BLOCK=block, num_warps=8))
            del src, dst
    except Exception as e:  # noqa: BLE001 - a failed probe only leaves the fuse decisions unmeasured
        err = _first_line(e)
    if not 0 < ms < math.inf:  # inf (failed), NaN, or a timer that returned nothing sensible
        _warn_once(("probe", str(device)),
                   f"the copy-bandwidth probe on {device} failed ({err}); fuse decisions that need the unfused "
                   f"norm's time are not measured (fused) until a probe succeeds")
        return 0.0
    gbps = 2 * numel * 2 / (ms * 1e6)
    _memo[key] = {"gbps": gbps}
    return gbps


# ----------------------------------------------------------------------------------------------------------
# Forward: fusenorm::mm_norm
# ----------------------------------------------------------------------------------------------------------


def _forward_key(a, b, bias, residual, weight, norm_bias, is_rms, out_dtype, save_normed) -> tuple:
    return (
        "mm_norm", a.device, _spec(a), _spec(b), _spec(bias), _spec(residual), _spec(weight), _spec(norm_bias),
        bool(is_rms), str(out_dtype or a.dtype), bool(save_normed),
    )


def _measure_forward(a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype, save_normed) -> dict:
    from .mm_norm_kernels import forward_candidates, mm_norm_triton

    dev = a.device
    with _RealInputs():
        ra = _RealInputs.like(a, dev)
        rb = _RealInputs.like(b, dev, scale=a.shape[1] ** -0.5)
        args = [_RealInputs.like(t, dev) for t in (bias, residual, weight, norm_bias)]
        times = {}
        out_bytes = forward_out_bytes(ra, residual, out_dtype, save_normed)
        gluon_args = (args[0], args[1], args[2], args[3], out_dtype, save_normed)
        for cand in forward_candidates(ra, rb, rb.shape[1], out_bytes, gluon_args):
            times[cand] = _time_ms(
                lambda c=cand: mm_norm_triton(ra, rb, *args, eps, is_rms, out_dtype, save_normed, config=c)
            )
        best = min(times, key=times.get)
        bias_r, res_r = args[0], args[1]
        t_mm = _gemm_ms(ra, rb, bias_r)
        # Inductor's norm reads h (and the residual) and writes y.
        t_norm = _norm_proxy_ms(ra.shape[0], rb.shape[1], ra.dtype, 3 if res_r is not None else 2, dev)
    return _entry(best, times, _plus(t_mm, t_norm))


def _entry(best, times: dict, t_unfused: Optional[float]) -> dict:
    return {
        "config": list(best),
        "t_fused_ms": times[best],
        "t_unfused_ms": t_unfused,
        "candidates": {c.label(): t for c, t in times.items()},
    }


def _config_of(entry: dict):
    """The entry's GemmConfig; ValueError (saying what is wrong) when its "config" does not make one."""
    from ._triton_common import GemmConfig

    cfg = entry.get("config")
    if not isinstance(cfg, (list, tuple)):
        raise ValueError(f"is {cfg!r}, not a list")
    fields = GemmConfig._fields
    required = len(fields) - len(GemmConfig._field_defaults)
    if not required <= len(cfg) <= len(fields):
        raise ValueError(f"{cfg!r} has {len(cfg)} fields, not {required} to {len(fields)}")
    for name, v in zip(fields, cfg):
        if name == "kind":
            ok = isinstance(v, str) and bool(v)
        elif name == "prefetch":
            ok = isinstance(v, bool)
        else:
            ok = isinstance(v, int) and not isinstance(v, bool) and v > 0
        if not ok:
            raise ValueError(f"{cfg!r} has {name} = {v!r}")
    return GemmConfig(*cfg)


def forward_out_bytes(a, residual, out_dtype, save_normed) -> int:
    """Bytes per element of the widest [M, N] output (4 when y or hh is fp32): it bounds the pipeline depth."""
    h_dtype = torch.promote_types(a.dtype, residual.dtype) if residual is not None else a.dtype
    wide = (out_dtype or a.dtype) == torch.float32 or (save_normed and h_dtype == torch.float32)
    return 4 if wide else 2


def forward_config(a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype, save_normed):
    """The GemmConfig the forward launcher runs for these (real) arguments (see _tuned_config)."""
    from .mm_norm_kernels import forward_candidates

    return _tuned_config(
        _forward_key(a, b, bias, residual, weight, norm_bias, is_rms, out_dtype, save_normed),
        a.device,
        lambda: forward_candidates(a, b, b.shape[1], forward_out_bytes(a, residual, out_dtype, save_normed),
                                   (bias, residual, weight, norm_bias, out_dtype, save_normed)),
        lambda: _measure_forward(a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype, save_normed),
    )


def _tuned_config(key: tuple, device: torch.device, candidates: Callable[[], list], measure: Callable[[], dict]):
    """The cached measurement when there is one (also while a CUDA graph is captured: the launcher's hot
    path is one dict lookup), else measure now and cache, else (no CUDA, tuning off, capturing, or a single
    candidate) the first candidate. In deterministic mode always the first candidate (module docstring)."""
    if torch.are_deterministic_algorithms_enabled():
        return candidates()[0]
    if device.type == "cuda":
        entry = _lookup(key)
        if entry is not None:
            return _config_of(entry)
    cands = candidates()
    if len(cands) == 1 or not _can_measure(device):
        return cands[0]
    entry = measure()
    _store(key, entry)
    return _config_of(entry)


def forward_choice(a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype, save_normed) -> Choice:
    """Whether ``mm_norm`` beats the unfused GEMM + norm on this shape, and with which configuration."""
    key = _forward_key(a, b, bias, residual, weight, norm_bias, is_rms, out_dtype, save_normed)
    measure = functools.partial(
        _measure_forward, a, b, bias, residual, weight, norm_bias, eps, is_rms, out_dtype, save_normed
    )
    choice = _choice(key, a.device, measure, lambda: _default_label(a))
    if a.device.type == "cuda" and not choice.config.startswith("gl_"):
        from .mm_norm_kernels import gluon_unsupported

        why = gluon_unsupported(a, b, bias, residual, weight, norm_bias, out_dtype, save_normed)
        if why is not None:
            choice = replace(choice, reason=f"{choice.reason}; Gluon sm_90 path not taken: {why}")
    return choice


def _default_label(t: Tensor) -> str:
    return f"{t.device.type} reference" if t.device.type != "cuda" else "the kernels' first candidate"


_PROBE_FAILED = "not measured: the copy-bandwidth probe failed, so the unfused norm's time is unknown"


def _choice(key, device, measure: Callable[[], dict], default_label: Callable[[], str],
            what: str = "cuBLAS GEMM + norm at copy speed") -> Choice:
    can = _can_measure(device)
    if not can and device.type != "cuda":
        return Choice(True, default_label(), "fused (not measured on CPU)")
    if torch.are_deterministic_algorithms_enabled():
        why = "not measured: deterministic algorithms are on, and timings are not deterministic"
        return Choice(True, default_label(), f"fused ({why})")
    if not can:
        return Choice(True, default_label(), "fused (not measured (config.tuning.measure off))")
    entry = _lookup(key)
    # An entry without the unfused time (a failed probe; in this process only) is measured again once the
    # probe works (a failed probe is not remembered).
    if entry is None or (entry["t_unfused_ms"] is None and copy_bandwidth_gbps(device) > 0):
        entry = measure()
        _store(key, entry)
    t_f, t_u = entry["t_fused_ms"], entry["t_unfused_ms"]
    label = _config_of(entry).label()
    if t_u is None:
        return Choice(True, label, f"fused ({_PROBE_FAILED})")
    margin = config.tuning.margin_gluon if label.startswith("gl_") else config.tuning.margin
    fuse = t_f < t_u * (1.0 - margin)
    verdict = "fused" if fuse else "left unfused: fusion would not win"
    reason = f"{verdict} (measured {t_f:.4g} ms fused [{label}] vs {t_u:.4g} ms {what})"
    return Choice(fuse, label, reason, t_f, t_u)


# ----------------------------------------------------------------------------------------------------------
# Backward: fusenorm::mm_norm_backward
# ----------------------------------------------------------------------------------------------------------


def _backward_key(dy, b, extra, src, weight, is_rms, src_is_normed, has_bias, dx_dtype) -> tuple:
    return (
        "mm_norm_backward", dy.device, _spec(dy), _spec(b), _spec(extra), _spec(src), _spec(weight),
        bool(is_rms), bool(src_is_normed), bool(has_bias), str(dx_dtype),
    )


def _measure_backward(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype) -> dict:
    from .mm_norm_backward_kernels import backward_candidates, mm_norm_backward_triton

    dev = dy.device
    with _RealInputs():
        rdy = _RealInputs.like(dy, dev)
        rb = _RealInputs.like(b, dev, scale=dy.shape[1] ** -0.5)
        rextra, rsrc, rw = (_RealInputs.like(t, dev) for t in (extra, src, weight))
        rmean = _RealInputs.like(mean, dev)
        rstd_r = _RealInputs.like(rstd, dev).abs_() + 0.5
        times = {}
        for cand in backward_candidates(rdy, rb, rb.shape[1], 4 if dx_dtype == torch.float32 else 2):
            times[cand] = _time_ms(
                lambda c=cand: mm_norm_backward_triton(
                    rdy, rb, rextra, rsrc, rw, rmean, rstd_r, is_rms, src_is_normed, has_bias, dx_dtype, config=c
                )
            )
        best = min(times, key=times.get)
        t_mm = _time_ms(lambda: torch.mm(rdy, rb))
        # The unfused norm backward reads dn and the saved tensor and writes dx (row sums stay on chip).
        t_norm = _norm_proxy_ms(rdy.shape[0], rb.shape[1], rdy.dtype, 3, dev)
    return _entry(best, times, _plus(t_mm, t_norm))


def backward_config(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype):
    """The GemmConfig the backward launcher runs for these (real) arguments (see _tuned_config)."""
    from .mm_norm_backward_kernels import backward_candidates

    return _tuned_config(
        _backward_key(dy, b, extra, src, weight, is_rms, src_is_normed, has_bias, dx_dtype),
        dy.device,
        lambda: backward_candidates(dy, b, b.shape[1], 4 if dx_dtype == torch.float32 else 2),
        lambda: _measure_backward(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype),
    )


def backward_choice(dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype) -> Choice:
    """Whether ``mm_norm_backward`` beats the unfused data-gradient GEMM + norm backward on this shape."""
    key = _backward_key(dy, b, extra, src, weight, is_rms, src_is_normed, has_bias, dx_dtype)
    measure = functools.partial(
        _measure_backward, dy, b, extra, src, weight, mean, rstd, is_rms, src_is_normed, has_bias, dx_dtype
    )
    return _choice(key, dy.device, measure, lambda: _default_label(dy))


# ----------------------------------------------------------------------------------------------------------
# Pre-norm forward: fusenorm::norm_mm (Lazy Pre-Norm)
# ----------------------------------------------------------------------------------------------------------


def _prenorm_key(a, b, bias, weight, norm_bias, is_rms, out_dtype) -> tuple:
    return (
        "norm_mm", a.device, _spec(a), _spec(b), _spec(bias), _spec(weight), _spec(norm_bias),
        bool(is_rms), str(out_dtype or a.dtype),
    )


def _measure_prenorm(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype) -> dict:
    from .norm_mm_kernels import norm_mm_triton, prenorm_candidates

    dev = a.device
    with _RealInputs():
        ra = _RealInputs.like(a, dev)
        rb = _RealInputs.like(b, dev, scale=a.shape[1] ** -0.5)
        rbias, rw, rnb = (_RealInputs.like(t, dev) for t in (bias, weight, norm_bias))
        times = {}
        for cand in prenorm_candidates(ra, rb, out_dtype or ra.dtype):
            times[cand] = _time_ms(
                lambda c=cand: norm_mm_triton(ra, rb, rbias, rw, rnb, eps, is_rms, out_dtype, config=c)
            )
        best = min(times, key=times.get)
        t_mm = _gemm_ms(ra, rb, rbias)
    return _entry(best, times, _plus(t_mm, _prenorm_norm_ms(a)))


def prenorm_norm_ms(a: Tensor) -> float:
    """The unfused pre-norm's time: Inductor's norm reads x and writes y, [M, K] each, at copy speed. 0.0 when
    the bandwidth probe failed (``prenorm_choice`` then reports no measurement, so the pattern does not use it)."""
    t = _prenorm_norm_ms(a)
    return 0.0 if t is None else t


def _prenorm_norm_ms(a: Tensor) -> Optional[float]:
    return _norm_proxy_ms(a.shape[0], a.shape[1], a.dtype, 2, a.device)


def prenorm_config(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype):
    """The GemmConfig the pre-norm launcher runs for these (real) arguments (see _tuned_config)."""
    from .norm_mm_kernels import prenorm_candidates

    return _tuned_config(
        _prenorm_key(a, b, bias, weight, norm_bias, is_rms, out_dtype),
        a.device,
        lambda: prenorm_candidates(a, b, out_dtype or a.dtype),
        lambda: _measure_prenorm(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype),
    )


def prenorm_choice(a, b, bias, weight, norm_bias, eps, is_rms, out_dtype) -> Choice:
    """Whether ``norm_mm`` beats the norm + cuBLAS GEMM on this shape (one consumer's view: with fan-out
    the pattern compares the consumers' sum against one norm + their GEMMs), and with which configuration."""
    key = _prenorm_key(a, b, bias, weight, norm_bias, is_rms, out_dtype)
    measure = functools.partial(_measure_prenorm, a, b, bias, weight, norm_bias, eps, is_rms, out_dtype)
    choice = _choice(key, a.device, measure, lambda: _default_label(b), what="norm at copy speed + cuBLAS GEMM")
    if choice.t_fused_ms is not None and _prenorm_norm_ms(a) is None:
        # A cached measurement, but the pattern weighs fan-out and weight-gradient rebuilds with
        # prenorm_norm_ms, which needs the copy bandwidth: without it the match counts as not measured.
        choice = Choice(True, choice.config, f"fused ({_PROBE_FAILED})")
    return choice
