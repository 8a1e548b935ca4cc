"""Per-shape measurements on the GPU and their cache, shared by the launch-time choice and the fuse decision.

The launch-time choices (``forward_config`` in tuning/mm_norm.py, ``backward_config`` in
tuning/mm_norm_backward.py, ``prenorm_config`` in tuning/norm_mm.py) ask ``tuned_config`` which of their
candidate configurations runs: the cached measurement for the call's shape, else the one for its bucket of
rows (``bucket_key``: a dynamic-M graph is decided at its traced M, and that decision serves the M of the same
bucket), else the first candidate (the kernels' best guess). A launch never measures: it runs inside the
user's step. Measuring happens at compile time, in the decision whether to fuse at all (tuning/decide.py:
each candidate timed with CUDA graphs on random inputs of the shape, the fastest kept), which writes the
entries the launches read. This module imports no kernel module: the op's tuning module passes its candidates and its
measuring function in.

Deterministic mode (``torch.use_deterministic_algorithms(True)``): nothing is timed and the cache is not
read, since timings (and so the choices made from them) differ from run to run. Every launch runs the
kernels' first candidate.

The cache is a JSON file (``config.tuning.cache_dir``, default ``~/.cache/fusenorm``) keyed by the GPU,
torch and triton versions, a hash of every package file, the TF32 setting and Inductor's mode, the shape,
dtypes and flags. Writers merge their entry into the file under a file lock and replace it atomically, so
concurrent processes lose nothing and readers never see half a file; a failed measurement (an inf or NaN
time) is kept in the process, never written. Besides the decisions it holds launch entries
(``make_launch_entry``: which candidate a GEMM of a deferred site runs, with no unfused time of their own).
Nothing about the cache fails a compile or a launch: a file that cannot be parsed or is not a JSON object,
and an entry of the wrong shape, count as absent (that shape is measured again, or runs the first candidate
where it cannot be), and a cache directory that cannot be written keeps measurements in the process only;
either warns once per file or directory, naming it.

The unfused norm's time needs the copy bandwidth, probed once per device and process
(``copy_bandwidth_gbps``). When the probe fails (it warns once; a failure is not remembered, so a later
call probes again), the launchers still run the fastest measured configuration; an entry without the
unfused time is kept in the process only, never written to the cache.

Keys read only shapes, dtypes, strides, devices and which optionals are present, so fake tensors from a
traced graph work.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import gc
import hashlib
import json
import math
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import Tensor

from .. import config, memory

CACHE_VERSION = 1
_memo: dict[tuple, dict] = {}  # in-process cache: key -> entry (as stored on disk)
_misses: set[tuple] = set()  # keys the disk cache did not have (read the file once per key, not per call)
_warned: set[tuple] = set()  # what was warned about already (a cache file, a cache directory, a probed device)


_generation = [0]  # bumped whenever an entry is stored or forgotten: launch plans made before are stale
# Wall seconds this process spent measuring, by part (what a first compile pays for the decisions; the model
# benchmark reports it next to the first step's time): "first_call" (each timed function's first call, which
# compiles a kernel), "timing" (CUDA-graph replays), "host" (host-time loops), "inductor_compile" (the
# baselines' nested compiles, ops/baseline.py). Never reset by ``clear_memory``; ``spent_seconds`` reads it.
_spent: dict[str, float] = {}


def spent_seconds() -> dict[str, float]:
    """A copy of the seconds spent measuring so far in this process, by part (see ``_spent``)."""
    return dict(_spent)


def add_spent(part: str, seconds: float) -> None:
    _spent[part] = _spent.get(part, 0.0) + seconds


def clear_memory() -> None:
    """Forget in-process results, the launch plans and caches made from them (``memory``), and which problems
    were warned about (the disk cache stays); tests use it."""
    memory.clear()
    _memo.clear()
    _misses.clear()
    _warned.clear()
    _generation[0] += 1


def plan_key(tensors: tuple, *flags) -> tuple:
    """The key of a launcher's cached launch plan (the fused ops' host cost: one dict lookup per call): what
    decides the kernel, its validation and its TMA descriptors of each tensor argument (shape, strides,
    dtype, device, 16-byte alignment), the op's flags, and what else changes the choice (the measurements,
    deterministic mode)."""
    return (*[None if t is None else (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15)
              for t in tensors], *flags, _generation[0], torch.are_deterministic_algorithms_enabled())


def warn_once(what: tuple, msg: str) -> None:
    """``warnings.warn`` (as the passes do), once per ``what`` and process."""
    if what not in _warned:
        _warned.add(what)
        warnings.warn(f"fusenorm: {msg}", stacklevel=3)


# ----------------------------------------------------------------------------------------------------------
# Keys and the disk cache
# ----------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _sources_hash() -> str:
    """A hash of every Python file of the package (patterns included), found by walking it: a measurement
    is only reused by the code that made it, and no list of files can forget a new one."""
    package = Path(__file__).parent.parent
    files = sorted(Path(d, f).relative_to(package).as_posix()
                   for d, _, names in os.walk(package, followlinks=True)  # patterns/ is a symbolic link
                   for f in names if f.endswith(".py"))
    h = hashlib.sha256()
    for name in files:
        h.update(name.encode())
        h.update((package / name).read_bytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def _device_tag(device: torch.device) -> str:
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"{name}|torch {torch.__version__}|triton {triton.__version__}"


def _cache_file() -> Path:
    root = config.tuning.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "fusenorm")
    return Path(root) / f"tuning-v{CACHE_VERSION}.json"


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _warn_file(path: Path, problem: str) -> None:
    warn_once(("read", str(path)), f"tuning cache {path}: {problem}; ignored (those shapes are measured again)")


def _read_disk() -> dict:
    """The cache file's entries; {} when there is none, or (warned once per file) when it cannot be read, is
    not JSON or is not a JSON object. Entries are not checked here (``lookup`` does, on use)."""
    path = _cache_file()
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):  # nothing measured yet (a cache_dir that is a file: on write)
        return {}
    except (OSError, ValueError) as e:  # unreadable, or not UTF-8
        _warn_file(path, f"cannot be read ({first_line(e)})")
        return {}
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        _warn_file(path, f"not valid JSON ({first_line(e)})")
        return {}
    if not isinstance(data, dict):
        _warn_file(path, f"not a JSON object but {type(data).__name__}")
        return {}
    return data


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock on ``path`` + ".lock" for a read-merge-replace of the cache file: without it two
    processes storing at once each replace the file with their own merge and one's entries are lost (six
    processes storing 40 entries each kept about half). Readers need none: the file is replaced atomically.
    Where ``fcntl`` is missing (Windows) writes go unlocked, as before."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def update_json_file(path: Path, read: Callable[[], dict], update: Callable[[dict], None],
                     sort_keys: bool = True) -> None:
    """Read-merge-replace of a file holding one JSON object, under its lock (``_file_lock``): ``update`` changes
    what ``read`` gives, and the result replaces the file atomically. Strict JSON (an inf or NaN raises
    ValueError); OSError, TypeError and ValueError are the caller's to handle."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(path):
            data = read()
            update(data)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=0, sort_keys=sort_keys, allow_nan=False)
            os.replace(tmp, path)  # atomic: readers see the old or the new file, never half of one
            tmp = None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _write_disk(key: str, entry: dict) -> None:
    path = _cache_file()
    try:
        # A malformed file (warned) is replaced by one holding this entry. Strict JSON: an inf or NaN here is a
        # bug (failed measurements are never stored), not a time.
        update_json_file(path, _read_disk, lambda data: data.__setitem__(key, entry))
    except (OSError, TypeError, ValueError) as e:
        # An unwritable cache only costs re-measuring in the next process.
        warn_once(("write", str(path.parent)),
                   f"cannot write the tuning cache in {path.parent} ({first_line(e)}); measurements are kept in "
                   f"this process only")


def entry_problem(entry) -> Optional[str]:
    """What is wrong with a cache entry read from disk, None if nothing (``_choice`` and ``tuned_config``
    read its config and its two times)."""
    if not isinstance(entry, dict):
        return f"an entry is {type(entry).__name__}, not an object"
    for name in ("t_fused_ms",) if _launch_only(entry) else ("t_fused_ms", "t_unfused_ms"):
        t = entry.get(name)
        # An inf (a failed measurement, written by earlier versions) counts as absent: measured again.
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t >= 0 and math.isfinite(t)):
            return f"an entry's {name!r} is {t!r}, not a time in ms"
    try:
        config_of(entry)
    except ValueError as e:
        return f"an entry's 'config' {e}"
    return None


def lookup(key: tuple, context: Optional[tuple] = None) -> Optional[dict]:
    """The entry for key (in ``context``, default the current ``_context``): this process's, else the disk
    cache's (a malformed one counts as absent), else None."""
    context = _context() if context is None else context
    key, disk_key = (*key, context), key
    if key in _memo:
        return _memo[key]
    if key in _misses:
        return None
    disk_key = _disk_key(disk_key, context)  # a JSON dump: only where the process has not looked yet
    data = _read_disk()
    entry = data.get(disk_key)
    if disk_key in data:
        problem = entry_problem(entry)
        if problem is not None:
            _warn_file(_cache_file(), problem)
            entry = None
    if entry is None:
        _misses.add(key)
    else:
        _memo[key] = entry
    return entry


def _ranks() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without torch.distributed."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or not config.tuning.agree_across_ranks:
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def agreed(key: tuple, decide: Callable[[], dict]) -> dict:
    """``decide()``'s entry for ``key``, the same on every rank: under torch.distributed rank 0 decides (from its
    cache or by measuring) and broadcasts its entry, which the other ranks keep as their own, so that no two
    ranks compile different graphs from different timings. Every rank must ask for the same keys in the same
    order: they compile the same graphs (SPMD, as DDP and FSDP do); where they do not, turn
    ``config.tuning.agree_across_ranks`` off and each rank decides alone."""
    rank, world = _ranks()
    if world == 1:
        return decide()
    import torch.distributed as dist

    box = [decide() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    entry = box[0]
    if rank != 0:
        store(key, entry, bucket=True)
    return entry


def store(key: tuple, entry: dict, bucket: bool = False) -> None:
    """Keep ``entry`` for ``key`` (and, with ``bucket``, for ``bucket_key(key)`` too: a compile-time decision
    also answers the launches of other M in its bucket)."""
    if bucket and bucket_key(key) != key:
        store(bucket_key(key), entry)
    disk_key, key = _disk_key(key), (*key, _context())
    _memo[key] = entry
    _generation[0] += 1
    _misses.discard(key)
    # Kept in this process only: a decision without the unfused time (a failed bandwidth probe), and an entry
    # with a failed measurement (an inf or NaN anywhere: a candidate that raised, e.g. after a transient CUDA
    # error), which on disk would keep that shape's verdict until the sources change. The next process measures
    # again. A launch entry has no unfused time by design and is written.
    if (entry.get("t_unfused_ms") is not None or _launch_only(entry)) and _finite(entry) \
            and entry.get("unfused_by") != TABLE:  # the table's decisions are remade from the table
        _write_disk(disk_key, entry)


def _finite(v) -> bool:
    """Whether every number in ``v`` (nested dicts and lists) is finite."""
    if isinstance(v, dict):
        return all(_finite(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return all(_finite(x) for x in v)
    return not isinstance(v, float) or math.isfinite(v)


def _context() -> tuple:
    """What besides the shapes changes a measurement: whether fp32 GEMMs may use TF32 (the kernels' and
    cuBLAS's speed, and so both sides), and the Inductor mode the unfused side is compiled in (max-autotune
    picks other GEMMs and kernels for Inductor's own code, tuning/baseline.py)."""
    import torch._inductor.config as inductor_config

    from ..kernels.triton import common

    autotune = inductor_config.max_autotune or inductor_config.max_autotune_gemm
    return ("tf32" if common._cuda_matmul_allows_tf32() else "ieee",
            "max-autotune" if autotune else "default",
            "coordinate-descent" if inductor_config.coordinate_descent_tuning else "")


def _disk_key(key: tuple, context: Optional[tuple] = None) -> str:
    context = _context() if context is None else context
    return json.dumps([_device_tag(key[1]), _sources_hash(), key[0], *key[2:], *context], default=str)


def _launch_contexts() -> list[tuple]:
    """The contexts a launch looks for its configuration in: the current one first, then the other Inductor
    modes' (the same TF32 setting). A graph compiled under ``mode="max-autotune"`` was decided in that mode's
    context, but its launches run outside the compile, where Inductor's config is the default again: the
    kernel measured fastest is the same whichever mode timed Inductor's side."""
    here = _context()
    others = [(here[0], m, c) for m in ("default", "max-autotune") for c in ("", "coordinate-descent")]
    return [here] + [c for c in others if c != here]


def spec(t: Optional[Tensor], rows: bool = False):
    """What of an argument decides the kernel and its speed (None stays None). ``rows``: t's first dim is the
    op's M (the rows of the activations, symbolic under dynamic shapes): marked so that ``bucket_key`` can
    find it."""
    if t is None:
        return None
    shape = tuple(t.shape)
    if rows:
        shape = (("rows", shape[0]), *shape[1:])
    return (shape, tuple(t.stride()), str(t.dtype))


def row_bucket(m: int) -> int:
    """The bucket of a row count: the next power of two (a kernel's best configuration changes slowly with M;
    one decision per bucket is what a dynamic-M graph gets)."""
    return 1 << max(0, int(m) - 1).bit_length()


def bucket_key(key: tuple) -> tuple:
    """``key`` with every row count (``spec(..., rows=True)``) replaced by its bucket."""
    def one(part):
        if isinstance(part, tuple) and len(part) == 3 and isinstance(part[0], tuple) and part[0] \
                and isinstance(part[0][0], tuple) and part[0][0][:1] == ("rows",):
            return ((("rows~", row_bucket(part[0][0][1])), *part[0][1:]), *part[1:])
        return part

    return tuple(one(p) for p in key)


# ----------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------


def decisions(device: torch.device) -> str:
    """How this compile decides its matches on ``device``: "measure" (time the candidates against Inductor's
    own code: ``mode="max-autotune"``, or ``config.tuning.measure = True``), "table" (the default mode: the
    shipped table of measurements, tuning/table.py, no timing), "fuse" (``config.tuning.measure = False``:
    every match fused with the kernels' first candidate) or "reference" (not CUDA: the CPU references)."""
    if device.type != "cuda":
        return "reference"
    how = config.tuning.measure
    if how is None:
        import torch._inductor.config as inductor_config

        how = True if (inductor_config.max_autotune or inductor_config.max_autotune_gemm) else None
    return "table" if how is None else ("measure" if how else "fuse")


def can_measure(device: torch.device) -> bool:
    return decisions(device) == "measure" and not torch.cuda.is_current_stream_capturing()


QUICK_LOOKS = 2  # single timed calls before the full timing, when a give-up time is known


def _one_call_ms(fn: Callable[[], object]) -> Optional[float]:
    """One call's GPU time between CUDA events; None when the call was host-bound (its launch took at least
    half of that): the events then time the launch (0.28 ms for a ~5 us kernel on the H200), not the kernel."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - t0) * 1e3
    end.record()
    end.synchronize()
    gpu_ms = float(start.elapsed_time(end))
    return gpu_ms if gpu_ms > 2.0 * host_ms else None


def refused(e: BaseException) -> bool:
    """Whether a candidate's failure is a refusal: the same for its specialization in every process (a kernel
    that spills registers, which its launcher never runs; one that does not fit the GPU's resources), not a
    failure of this run (a transient CUDA error). The kernels mark theirs with a true ``refusal`` attribute."""
    from triton.runtime.errors import OutOfResources

    return bool(getattr(e, "refusal", False)) or isinstance(e, OutOfResources)


def time_ms(fn: Callable[[], object], give_up_ms: Optional[float] = None) -> float:
    """Median GPU time of fn in a CUDA graph (leaves out the CPU launch cost, which a training step
    overlaps with earlier kernels); inf when fn fails (e.g. a config that does not fit shared memory).
    With ``give_up_ms``: a quick look first (the fastest of ``QUICK_LOOKS`` single calls, CUDA events), and
    when even that is slower than give_up_ms, its time is returned without the full timing (which costs
    a graph capture and ~``tuning.rep_ms`` of replays: most of what a decision adds to the first step)."""
    from triton.testing import do_bench_cudagraph

    t0 = time.perf_counter()
    part = "first_call"
    try:
        fn()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        add_spent(part, t1 - t0)
        t0, part = t1, "timing"
        if give_up_ms is not None:
            looks = [_one_call_ms(fn) for _ in range(QUICK_LOOKS)]
            quick = None if None in looks else min(looks)
            if quick is not None and quick > give_up_ms:
                return quick
        return float(do_bench_cudagraph(fn, rep=config.tuning.rep_ms, return_mode="median"))
    except Exception:  # noqa: BLE001 - a failing candidate is simply not chosen
        try:
            torch.cuda.synchronize()  # let an asynchronous failure surface here, not in the next candidate
        except Exception:  # noqa: BLE001 - a sticky CUDA error raises again: it is the same failure
            pass
        return float("inf")
    finally:
        add_spent(part, time.perf_counter() - t0)


class RealInputs:
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


def real_gemm_operands(a: Tensor, b: Tensor, *others: Optional[Tensor], device: Optional[torch.device] = None
                       ) -> list:
    """Inside ``RealInputs``: random real a and b like the given ones (b scaled by 1/sqrt(K), so that the
    product has unit scale), then each of ``others`` (None stays None), all on ``device`` (default a's)."""
    dev = a.device if device is None else device
    return [RealInputs.like(a, dev), RealInputs.like(b, dev, scale=a.shape[1] ** -0.5),
            *(RealInputs.like(t, dev) for t in others)]


# A first candidate slower than this times the unfused estimate ends the timing: the others would have to be
# ~2.4x faster than the kernels' best guess to win by the margin, and each one timed costs the first compile.
GIVE_UP = 2.0


def time_candidates(candidates, run: Callable[[object], object], unfused_ms: Optional[float] = None) -> tuple:
    """(fastest, {candidate: ms}): each candidate configuration timed as ``run(candidate)``, best guess first;
    when the first one timed takes over ``GIVE_UP`` x ``unfused_ms`` (the unfused estimate, when known) the
    rest are not timed (they are left out of the times). A candidate whose quick look (``time_ms``) is already
    over that keeps the quick look's time: it cannot be chosen over the unfused path either way. A candidate
    ``refused`` (it spills, or does not fit) is left out too: it runs nowhere, and an inf among the times would
    keep the whole entry off the disk cache (a failed measurement), so every process would measure the shape
    again. Where every candidate is refused: (the first, {the first: inf})."""
    times = {}
    give_up = GIVE_UP * unfused_ms if unfused_ms else None
    compile_ahead(candidates, run)
    for c in candidates:
        failures: list = []

        def call(c=c, failures=failures):
            try:
                return run(c)
            except Exception as e:
                failures.append(e)
                raise

        t = time_ms(call, give_up)
        if failures and refused(failures[-1]):
            continue
        times[c] = t
        if len(times) == 1 and give_up is not None and t > give_up:
            break
    if not times:
        return candidates[0], {candidates[0]: math.inf}
    return min(times, key=times.get), times


def compile_ahead(candidates, run: Callable[[object], object]) -> None:
    """Each candidate's first call, ``run(candidate)``, in up to ``config.tuning.compile_threads`` threads at
    once, so that their kernels compile in parallel before ``time_candidates`` times them one by one (a
    first call compiles; triton keeps the kernel). What a call raises is left to the timing, which calls it
    again and handles it as it always has. CUDA only; one candidate or one thread: nothing to do."""
    threads = min(config.tuning.compile_threads, len(candidates))
    if threads < 2 or not torch.cuda.is_available():
        return
    device = torch.cuda.current_device()

    def first(c) -> None:
        torch.cuda.set_device(device)
        try:
            run(c)
        except Exception:  # noqa: BLE001 - the timing runs it again and meets the same error there
            pass

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="fusenorm-compile") as pool:
        list(pool.map(first, candidates))
    try:
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001 - a failed launch's error surfaces again in the timing of that candidate
        pass
    add_spent("first_call", time.perf_counter() - t0)


def gemm_ms(a: Tensor, b: Tensor, bias: Optional[Tensor]) -> float:
    """cuBLAS's time for the unfused graph's linear: addmm with a bias, else mm."""
    return time_ms((lambda: torch.addmm(bias, a, b)) if bias is not None else (lambda: torch.mm(a, b)))


def norm_proxy_ms(m: int, n: int, dtype: torch.dtype, passes: int, device: torch.device) -> Optional[float]:
    """The unfused norm's time, taken as ``passes`` streams of [m, n] elements at the copy bandwidth:
    Inductor's norm kernels reach it on these shapes (docs/baselines-h200.md). (torch's own ``copy_`` does not:
    ~2.7 of ~4.2 TB/s on the H200, which would make the unfused path look slower than it is.) None when the
    bandwidth probe failed."""
    gbps = copy_bandwidth_gbps(device)
    if not gbps > 0:
        return None
    itemsize = torch.empty((), dtype=dtype).element_size()
    return passes * m * n * itemsize / (gbps * 1e6)


def plus(t_mm: float, t_norm: Optional[float]) -> Optional[float]:
    """The unfused path's time; None (not measured) without the norm's."""
    return None if t_norm is None else t_mm + t_norm


@functools.cache
def _copy_kernel():
    """The copy kernel the bandwidth probe times (a function, so that tests can stand in for it)."""
    from ..kernels.triton.common import copy_kernel

    return copy_kernel


def copy_bandwidth_gbps(device: torch.device) -> float:
    """Streaming bandwidth (read + write) of a wide Triton copy of 256 MiB, GB/s; measured once per device
    (also the benchmark's bandwidth ceiling) and kept in the tuning cache beside the decisions: a later
    process whose decisions are all cached would otherwise pay the probe's kernel compile and timing in its
    first step only to weigh them. 256 MiB is several times any L2, so the copy runs at memory speed; the two
    buffers go back to the driver after the probe where it made the caching allocator reserve more (a compile
    must not leave the user's process holding memory). 0.0 when the probe fails (the copy does not run, or the
    memory is not free): that warns once per device and is not remembered, so the next call probes again."""
    key = ("copy_gbps", device)
    if key in _memo:
        return _memo[key]["gbps"]
    if decisions(device) == "table":
        from . import table

        gbps = table.copy_gbps(device)  # measured with the table: the default mode times nothing
        if gbps is not None:
            return gbps
    disk_key = _disk_key(key)
    stored = _read_disk().get(disk_key)
    if isinstance(stored, dict) and _positive(stored.get("gbps")):
        _memo[key] = {"gbps": float(stored["gbps"])}
        return _memo[key]["gbps"]
    numel = 1 << 27
    ms, err = math.inf, "the timed copy kernel failed"
    reserved = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    try:
        import triton

        with RealInputs():
            src = torch.empty(numel, dtype=torch.bfloat16, device=device)
            dst = torch.empty_like(src)
            block = 8192
            kernel = _copy_kernel()
            ms = time_ms(lambda: kernel[(triton.cdiv(numel, block),)](src, dst, numel, BLOCK=block, num_warps=8))
            del src, dst
    except Exception as e:  # noqa: BLE001 - a failed probe only leaves the fuse decisions unmeasured
        err = first_line(e)
    if device.type == "cuda" and torch.cuda.memory_reserved(device) > reserved:
        torch.cuda.empty_cache()
    if not 0 < ms < math.inf:  # inf (failed), NaN, or a timer that returned nothing sensible
        warn_once(("probe", str(device)),
                   f"the copy-bandwidth probe on {device} failed ({err}); fuse decisions that need the unfused "
                   f"norm's time are not measured (fused) until a probe succeeds")
        return 0.0
    gbps = 2 * numel * 2 / (ms * 1e6)
    _memo[key] = {"gbps": gbps}
    _write_disk(disk_key, {"gbps": gbps})
    return gbps


def _positive(v) -> bool:
    """Whether ``v`` is a finite number above 0 (not a bool): a stored bandwidth that can be used."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf


# ----------------------------------------------------------------------------------------------------------
# Entries and the launchers' lookup
# ----------------------------------------------------------------------------------------------------------


def make_entry(best, times: dict, t_unfused: Optional[float], h_fused_us: Optional[float] = None,
               inductor: Optional[tuple] = None) -> dict:
    """A cache entry: the fastest candidate, every candidate's time, the unfused time, and the fused call's
    host time (``fused_host_us``; None when not measured). ``inductor``: (ms, host us) of Inductor's own code
    for the unfused subgraph (ops/baseline.py); when given it is the unfused time ("unfused_by": "inductor"),
    else ``t_unfused`` is the estimate (cuBLAS + a norm at copy speed)."""
    entry = {
        "config": list(best),
        "t_fused_ms": times[best],
        "t_unfused_ms": t_unfused,
        "candidates": {c.label(): t for c, t in times.items()},
        "h_fused_us": h_fused_us,
        "unfused_by": "estimate",
    }
    if inductor is not None:
        entry.update(t_unfused_ms=inductor[0], h_unfused_us=inductor[1], unfused_by="inductor",
                     t_unfused_estimate_ms=t_unfused)
    return entry


LAUNCH_ONLY = "none: a launch's choice"  # ``unfused_by`` of ``make_launch_entry``'s entries
TABLE = "table"  # ``unfused_by`` of the entries the table's decisions keep in the process (never on disk)


def make_launch_entry(best, times: dict) -> dict:
    """An entry that only says which candidate a launch runs (``tuned_config``), with no fuse decision under its
    key: a GEMM of a deferred site, whose decision is the site's own entry. Kept on disk like a decision: a
    later process that finds the site's decision cached does not measure the site again, and its launches
    would otherwise run the first candidate instead of the one measured fastest."""
    return {**make_entry(best, times, None), "unfused_by": LAUNCH_ONLY}


def _launch_only(entry: dict) -> bool:
    return entry.get("unfused_by") == LAUNCH_ONLY


# ----------------------------------------------------------------------------------------------------------
# Host cost: what a call costs the CPU, which bounds a step that runs without CUDA graphs when kernels are short
# ----------------------------------------------------------------------------------------------------------


def margin_for(label: str) -> float:
    """The fraction a fused kernel must win by (``tuning.margin``; ``margin_gluon`` for a Gluon config label)."""
    return config.tuning.margin_gluon if label.startswith("gl_") else config.tuning.margin


def host_counts() -> bool:
    """Whether host time counts in the decision: the graph being compiled will not run under CUDA graphs
    (``mode="reduce-overhead"`` pays a call's host time once, at capture, not per step) and
    ``tuning.host_weight`` is not 0."""
    import torch._inductor.config as inductor_config

    return config.tuning.host_weight > 0 and not inductor_config.triton.cudagraphs


# GPU work per host-time loop, ms: enough calls for a steady host pace, few enough that the sync after each
# loop (waiting for the queued kernels, which the first compile pays for) stays short.
_HOST_LOOP_GPU_MS = 4.0


def host_us(fn: Callable[[], object], calls: int = 20, repeats: int = 5, gpu_ms: Optional[float] = None
            ) -> Optional[float]:
    """Host time per call of fn: the wall time of back-to-back calls without a sync (the launches queue up
    on the GPU, so the loop runs at the CPU's pace), the least of ``repeats`` loops; None when fn fails.
    ``gpu_ms``: fn's GPU time, when known; long kernels get fewer calls per loop (at least 3)."""
    if gpu_ms and gpu_ms > 0:
        calls = max(3, min(calls, int(_HOST_LOOP_GPU_MS / gpu_ms)))
    start = time.perf_counter()
    collecting = gc.isenabled()
    try:
        fn()
        torch.cuda.synchronize()
        best = math.inf
        # As timeit does: a garbage collection landing in a loop (the compile leaves many objects behind)
        # would charge its pause to the calls timed there.
        gc.disable()
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best = min(best, (time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
        return best
    except Exception:  # noqa: BLE001 - a host time is advice: without it the decision uses GPU times only
        return None
    finally:
        if collecting:
            gc.enable()
        add_spent("host", time.perf_counter() - start)


def _call_overhead_us() -> float:
    """Host time per fused call outside the launch itself (measured once per process, device and call path):
    with direct graph calls (graph_calls.py) the call wrapper, the launch plan's lookup and Inductor's size
    checks on the op's outputs (up to four: y and what the backward keeps); otherwise the dispatcher's round
    trip into the custom op and the plan's lookup."""
    from .. import graph_calls

    direct = graph_calls.active()
    key = ("call_overhead_us", torch.cuda.current_device(), direct)
    if key not in _memo:
        with RealInputs():
            x = torch.empty(16, device="cuda")
            key_args = ((x, x, None, x, x, None), 1e-5, True, None, False)
            if direct:
                from torch._C._dynamo.guards import assert_size_stride

                # the op's direct call as graph_calls makes it, around a body that does nothing
                call = graph_calls.wrap("fusenorm::host_probe", lambda t: t.new_empty((0,)),
                                        torch.ops.fusenorm.host_probe.default)

                def probe():
                    out = (call(x), x, x, x)
                    plan_key(*key_args)
                    for t in out[1:]:
                        assert_size_stride(t, (16,), (1,))
            else:
                op = torch.ops.fusenorm.host_probe.default

                def probe():
                    op(x)
                    plan_key(*key_args)
            us = host_us(probe, calls=100)
        _memo[key] = {"us": us or 0.0}
    return _memo[key]["us"]


HOST_REPEATS_FUSED = 10


def fused_host_us(launch: Callable[[], object], gpu_ms: Optional[float] = None) -> Optional[float]:
    """A fused op's host time per call in a compiled graph: ``launch``'s host time (``gpu_ms``: its GPU time,
    see ``host_us``) plus what the call costs around it (``_call_overhead_us``: with direct graph calls about
    the unfused pair's, through the dispatcher 15-40 us more; docs/history/design-history.md, "Graph calls")."""
    # more loops than the default: a fused op's host time can turn its verdict (decide._judge weighs it),
    # and only noise raises the least of them
    t = host_us(launch, gpu_ms=gpu_ms, repeats=HOST_REPEATS_FUSED) if torch.cuda.is_available() else None
    if t is None:
        return None
    return t + _call_overhead_us()


def unfused_host_us(device: torch.device) -> Optional[float]:
    """The unfused pair's host time per call: cuBLAS's GEMM and one Triton kernel launch (Inductor's norm),
    on small inputs; measured once per device and process (None when it cannot be)."""
    key = ("unfused_host_us", device)
    if not torch.cuda.is_available():
        return None
    if key not in _memo and decisions(device) == "table":
        from . import table

        us = table.unfused_host_us(device)  # measured with the table: the default mode times nothing
        if us is not None:
            return us
    if key not in _memo:
        import triton

        with RealInputs():
            a = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
            src, dst = torch.empty(1024, device=device), torch.empty(1024, device=device)
            kernel = _copy_kernel()
            mm = host_us(lambda: torch.mm(a, a), calls=100)
            launch = host_us(lambda: kernel[(triton.cdiv(1024, 1024),)](src, dst, 1024, BLOCK=1024), calls=100)
        _memo[key] = {"us": None if mm is None or launch is None else mm + launch}
        if _memo[key]["us"] is not None:
            _write_disk(_disk_key(key), _memo[key])  # for the decision table built from this cache
    return _memo[key]["us"]


def config_of(entry: dict):
    """The entry's configuration (kernels/triton's GemmConfig, or a backend's own: backends.config_from);
    ValueError (saying what is wrong) when its "config" does not make one."""
    from ..backends import config_from
    from ..kernels.gemm_config import GemmConfig

    cfg = entry.get("config")
    if not isinstance(cfg, (list, tuple)):
        raise ValueError(f"is {cfg!r}, not a list")
    other = config_from(list(cfg))  # a backend with its own configuration type (quack)
    if other is not None:
        return other
    fields = GemmConfig._fields
    required = len(fields) - len(GemmConfig._field_defaults)
    if not required <= len(cfg) <= len(fields):
        raise ValueError(f"{cfg!r} has {len(cfg)} fields, not {required} to {len(fields)}")
    for name, v in zip(fields, cfg):
        if name == "kind":
            ok = isinstance(v, str) and bool(v)
        elif name in ("prefetch", "stats_regs"):
            ok = isinstance(v, bool)
        else:
            ok = isinstance(v, int) and not isinstance(v, bool) and v > 0
        if not ok:
            raise ValueError(f"{cfg!r} has {name} = {v!r}")
    return GemmConfig(*cfg)


def tuned_config(key: tuple, device: torch.device, candidates: Callable[[], list]):
    """The configuration a launch runs: the measurement the compile-time decision cached for this shape (also
    while a CUDA graph is captured: the launcher's hot path is one dict lookup), else the one cached for its
    bucket of M (``bucket_key``: what a dynamic-M graph was decided at), in this Inductor mode's context or
    another's (``_launch_contexts``), else in the default mode the table's configuration for the shape, else
    the kernels' first candidate.
    Never a timing: a launch happens inside the user's step, where measuring (CUDA-graph captures, a nested
    compile) would stall it. In deterministic mode always the first candidate (module docstring)."""
    if torch.are_deterministic_algorithms_enabled():
        return candidates()[0]
    if device.type == "cuda":
        for context in _launch_contexts():
            entry = lookup(key, context) or lookup(bucket_key(key), context)
            if entry is not None:
                return config_of(entry)
        if decisions(device) == "table":
            # the default mode's decision kept its configuration in the process that compiled; a later process
            # that loads the compiled graph from Inductor's cache asks the table again
            from . import table

            points, _ = table.lookup(key, device, _context())
            if points is not None and points[2].get("config"):
                return config_of(points[2])
    return candidates()[0]
