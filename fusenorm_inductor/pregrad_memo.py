"""What the pre-grad stage concluded about a graph it left exactly as traced, kept across processes.

The pre-grad stage runs before Inductor's caches are consulted (Dynamo hands the torch-level graph to the
pre-grad passes on every compile, warm caches or not), and on a GPU it asks each joint-graph fusion whether it
would take each norm (patterns/prospects.py): decisions, table lookups, the kernels' availability checks.
Where it ends with the graph unchanged (no fusion would take anything), a second run of the same script would
do all of that again to reach the same answer. So, in the default mode (decisions from the shipped table, no
timing: ``measure.decisions`` is "table"), the stage's verdict on such a graph is kept here under a key of
everything the verdict depends on, and a later compile of the same graph replays the report's lines instead
of running the stage.

The key: the graph's structure (each node's op, target, arguments and the shape, strides, dtype, device and
requires_grad of its value), fusenorm's sources and config (as Inductor's cache key takes them: passes.py),
the decision table's file, the tuning cache file's content (a measured entry there decides before the
table), the Inductor mode and TF32 setting (``measure._context``), whether host time counts (CUDA graphs or
not), the device, torch and triton. Graphs the stage changed are not kept: their rewrites must run; nor are
dynamic graphs (their decisions are made at the traced example's sizes, which the structure does not show); nor is
anything under torch.distributed with ranks agreeing on decisions (each rank must take part in the stage's
collectives). Measured decisions (max-autotune) are not kept either: the tuning cache keeps their timings,
and their users accept the compile time.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import torch
import torch.fx as fx

from . import config, memory, report
from .fx_utils import val
from .tuning import measure, table

VERSION = 1
MAX_ENTRIES = 1024  # the file keeps the newest this many graphs
# emptied with the tuning memory (measure.clear_memory): a verdict is not reused past the measurements'
_memo: dict[str, dict] = memory.cache()
_on_disk: list = memory.cache([])  # [the file's entries] once this process has read it (every compile asks)


def _file() -> Path:
    return measure._cache_file().with_name(f"pregrad-v{VERSION}.json")


def static_sizes(t: torch.Tensor) -> bool:
    """Whether every size and stride of ``t`` is a plain int (no symbolic size of a dynamic graph)."""
    return all(type(d) is int for d in (*t.shape, *t.stride()))


def _device(graph: fx.Graph) -> Optional[torch.device]:
    """The graph's one CUDA device, else None (CPU graphs, several devices, symbolic sizes: a dynamic graph's
    decisions are made at the traced example's sizes, which its structure does not show)."""
    devices = set()
    for node in graph.nodes:
        v = val(node)
        for t in v if isinstance(v, (list, tuple)) else (v,):
            if isinstance(t, torch.Tensor):
                if not static_sizes(t):
                    return None
                devices.add(t.device)
    cuda = {d for d in devices if d.type == "cuda"}
    return next(iter(cuda)) if len(cuda) == 1 else None


def _value_text(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"T{tuple(v.shape)}{tuple(v.stride())}{v.dtype}{v.device}{int(v.requires_grad)}"
    if isinstance(v, (list, tuple)):
        return "(" + ",".join(_value_text(x) for x in v) + ")"
    return type(v).__name__


def _text(x, index: dict) -> str:
    """A node's target or argument as text that is the same in every process (no object addresses; a node
    by its position, since a norm put back as traced may come back under another name)."""
    if isinstance(x, fx.Node):
        return f"%{index.get(x, '?')}"
    if isinstance(x, (list, tuple)):
        return "(" + ",".join(_text(v, index) for v in x) + ")"
    if isinstance(x, dict):
        return "{" + ",".join(f"{k}:{_text(v, index)}" for k, v in x.items()) + "}"
    if x is None or isinstance(x, (str, int, float, bool, slice, torch.dtype, torch.device, torch.layout,
                                   torch.memory_format)):
        return repr(x)
    if callable(x):
        return f"{getattr(x, '__module__', '')}.{getattr(x, '__qualname__', getattr(x, '__name__', type(x).__name__))}"
    return type(x).__name__


def structure(graph: fx.Graph) -> str:
    """The graph as the pre-grad stage sees it: nodes in order, targets, arguments, values (not names or source
    lines)."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    return "\n".join(f"{n.op}|{_text(n.target, index)}|{_text(n.args, index)}|{_text(n.kwargs, index)}|"
                     f"{_value_text(val(n))}" for n in graph.nodes)


def key(graph: fx.Graph, uuid: tuple) -> Optional[tuple[str, str]]:
    """(the memo key of ``graph``, its ``structure``) (``uuid``: the pre-grad pass's cache key parts, passes.py),
    or None where the verdict is not kept: no single CUDA device, decisions not from the table, deterministic
    mode, debug dumps, or anything failing on the way (the stage then runs as always)."""
    try:
        return _key(graph, uuid)
    except Exception:  # noqa: BLE001 - the memo is an optimization: never a reason for a compile to fail
        return None


def _key(graph: fx.Graph, uuid: tuple) -> Optional[tuple[str, str]]:
    device = _device(graph)
    if device is None or config.debug_dir or torch.are_deterministic_algorithms_enabled():
        return None
    if measure.decisions(device) != "table":
        return None
    if measure._ranks()[1] > 1:  # ranks agree on decisions through collectives: all must run the stage
        return None
    import triton

    fam = table.family(device)
    path = table.TABLES / f"{fam}.json"
    table_hash = hashlib.sha256(path.read_bytes()).hexdigest() if fam and path.is_file() else "-"
    try:  # its content, not its time stamp: a compile that writes back the same entries keeps the key
        tuning_file = hashlib.sha256(measure._cache_file().read_bytes()).hexdigest()
    except OSError:
        tuning_file = "-"
    text = structure(graph)
    h = hashlib.sha256()
    for part in (*uuid, table_hash, tuning_file, repr(measure._context()), measure.host_counts(),
                 torch.cuda.get_device_name(device), torch.__version__, triton.__version__, text):
        h.update(str(part).encode())
        h.update(b"\0")
    return h.hexdigest(), text


def _read() -> dict:
    try:
        with open(_file()) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def get(k: str) -> Optional[dict]:
    """The kept verdict for key ``k``: this process's, else the file's; None when there is none."""
    if k not in _memo:
        if not _on_disk:
            _on_disk.append(_read())
        entry = _on_disk[0].get(k)
        if not (isinstance(entry, dict) and isinstance(entry.get("skips"), list)
                and all(isinstance(x, list) and len(x) == 5 and all(isinstance(v, str) for v in x)
                        for x in entry["skips"])
                and all(isinstance(n, str) for n in entry.get("notes", []))):
            return None  # absent, or not what ``put`` writes: the stage runs
        _memo[k] = entry
    return _memo[k]


def put(k: str, rep: report.GraphReport, since: tuple[int, int]) -> None:
    """Keep the verdict of a stage run that left its graph unchanged: the report's skips and notes recorded
    after the counts ``since``. A file that cannot be written keeps it in this process only."""
    entry = {"skips": [[s.pattern, s.stage, s.node, s.reason, s.where] for s in rep.skips[since[1]:]],
             "notes": list(rep.notes)}
    _memo[k] = entry

    def update(data: dict) -> None:
        data.pop(k, None)
        data[k] = entry  # last: the file keeps its entries oldest first
        while len(data) > MAX_ENTRIES:
            data.pop(next(iter(data)))

    try:
        measure.update_json_file(_file(), _read, update, sort_keys=False)
    except (OSError, TypeError, ValueError):
        pass


def replay(rep: report.GraphReport, entry: dict) -> None:
    """Put a kept verdict's lines into this compile's report."""
    for pattern, stage, node, reason, where in entry["skips"]:
        rep.skip(pattern, stage, node, reason)
        rep.skips[-1].where = where
    for note in entry.get("notes", []):
        rep.note(note)


def clear() -> None:
    """Forget this process's kept verdicts and what it read of the file (the file stays); tests use it."""
    _memo.clear()
    _on_disk.clear()
