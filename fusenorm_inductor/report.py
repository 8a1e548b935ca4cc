"""The match report: what each compiled graph had rewritten, what was seen but left alone and why.

One ``GraphReport`` per compiled graph (Dynamo frame compile). Every pass stage adds to it; when
``config.debug_dir`` is set (``~`` expanded) the report and the graphs before/after each stage are written
under a folder of their own per process, ``<debug_dir>/run-<time>-<pid>-<random>/<NNN>_<compile id>/``, with an
``index.md`` / ``index.json`` there listing the graphs written in that run. A graph that Inductor serves from
its caches (AOTAutograd / FX graph cache) is not recompiled and fusenorm's passes do not run for it: it gets a
report saying so (``cache_hit``), with no rewrites listed. Rewrites are also counted in
``torch._dynamo.utils.counters["fusenorm"][<pattern name>]``; each stage logs a one-line summary on the
``fusenorm`` logger (``TORCH_LOGS="+fusenorm"``) and, at DEBUG level, one line per candidate not rewritten.

The dumps never follow a symbolic link: the folders are created private (mode 0700), each write opens its
folder with ``O_NOFOLLOW`` and checks it is the one created, files are created with ``O_EXCL | O_NOFOLLOW``
and renamed into place, and a ``debug_dir`` with a symbolic link anywhere on its path (itself or a parent) is
refused (the callers warn once per graph, naming the link).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import secrets
import stat
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional

from torch._dynamo.utils import counters

from . import config

log = logging.getLogger("fusenorm")

_seq = itertools.count()


@dataclass
class Rewrite:
    pattern: str
    stage: str
    nodes: list[str]
    shapes: dict[str, Any]
    dtype: str
    kernel: str
    detail: str = ""
    measure_s: float = 0.0  # seconds the match's decision spent measuring (a first compile's cost)
    where: str = ""  # the model's own name for the site: module path and source line (``locate``)


@dataclass
class Skip:
    pattern: str
    stage: str
    node: str
    reason: str
    measure_s: float = 0.0
    where: str = ""


def node_place(meta: dict) -> tuple[str, str]:
    """Where an FX node came from in the user's model, from its ``meta``: (the module path Dynamo recorded,
    ``layers.0.norm``; the source line of the call outside torch, ``model.py:42``), each "" where it lacks it."""
    import re

    stack = meta.get("nn_module_stack") or {}
    path = ""
    if stack:
        raw = str(list(stack.values())[-1][0])
        path = re.sub(r"^L\['[^']*'\]\.?", "", raw)
        path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
        path = re.sub(r"\[(\d+)\]", r".\1", path).strip(".")
    frames = re.findall(r'File "([^"]+)", line (\d+)', meta.get("stack_trace") or "")
    own = [f for f in frames if f"{os.sep}torch{os.sep}" not in f[0] and "site-packages" not in f[0]] or frames
    return path, (f"{os.path.basename(own[-1][0])}:{own[-1][1]}" if own else "")


def place_text(places: list[tuple[str, str]]) -> str:
    """"module a + b (file.py:12)" from the (module path, line) of a site's nodes."""
    paths = list(dict.fromkeys(p for p, _ in places if p))
    line = next((ln for _, ln in places if ln), "")
    return " ".join(t for t in (("module " + " + ".join(paths)) if paths else "", f"({line})" if line else "") if t)


def _uncount(pattern: str) -> None:
    counters["fusenorm"][pattern] -= 1
    if not counters["fusenorm"][pattern]:
        del counters["fusenorm"][pattern]


def _plain(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v if isinstance(v, (int, float, str, type(None))) else str(v)


@dataclass
class GraphReport:
    graph_id: str
    rewrites: list[Rewrite] = field(default_factory=list)
    skips: list[Skip] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    dumps: dict[str, str] = field(default_factory=dict)
    # What holds for the whole graph rather than one site (a kernel backend that could not be offered), each once.
    notes: list[str] = field(default_factory=list)
    # A graph left to Inductor on the CPU (config.cpu_reference off): what fusenorm would rewrite on a GPU.
    on_gpu: list[str] = field(default_factory=list)
    # Inductor served this graph from its caches, so fusenorm's passes did not run: hits counted during its
    # compile, by cache ("aot_autograd", "fx_graph"). Empty for a graph the passes ran on.
    cache_hit: dict[str, int] = field(default_factory=dict)
    # Where write() put it: (the run, the folder's (st_dev, st_ino)); later writes go to that same folder.
    _written_to: Optional[tuple] = field(default=None, repr=False, compare=False)
    # Warnings already given for this graph (a debug_dir that cannot be written fails at every stage's write:
    # the user hears it once per graph).
    _warned: set = field(default_factory=set, repr=False, compare=False)

    def warn_once(self, text: str) -> None:
        if text not in self._warned:
            self._warned.add(text)
            warnings.warn(f"fusenorm: {text}")

    def charge(self, seconds: float, since: tuple[int, int]) -> None:
        """Put the seconds a match spent measuring on the first entry it recorded after ``since`` (the counts
        of rewrites and skips before it)."""
        entries = self.rewrites[since[0]:] + self.skips[since[1]:]
        if seconds > 0 and entries:
            entries[0].measure_s += seconds

    def rewrite(self, pattern: str, stage: str, nodes, shapes, dtype, kernel, detail: str = "") -> None:
        shapes = {k: _plain(v) for k, v in shapes.items()}  # symbolic sizes (dynamic shapes) as text
        self.rewrites.append(
            Rewrite(pattern, stage, [str(n) for n in nodes], shapes, str(dtype).replace("torch.", ""), kernel, detail)
        )
        counters["fusenorm"][pattern] += 1

    def preview(self, text: str) -> None:
        if text not in self.on_gpu:
            self.on_gpu.append(text)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def skip(self, pattern: str, stage: str, node, reason: str) -> None:
        self.skips.append(Skip(pattern, stage, str(node), reason))
        if log.isEnabledFor(logging.DEBUG):  # TORCH_LOGS="+fusenorm": every candidate left alone, and why
            log.debug("fusenorm [%s] %s: %s not rewritten at %s: %s", self.graph_id, stage, pattern, node,
                      " ".join(str(reason).split()))

    def retract(self, record: Rewrite) -> None:
        """Forget one rewrite that was undone (a canonical norm put back as written: patterns/prospects.py)."""
        self.rewrites.remove(record)
        _uncount(record.pattern)

    def locate(self, metas: dict, since: tuple[int, int]) -> None:
        """Name the model's place (``node_place``) of every entry recorded after the counts ``since``, from
        ``metas``: node name -> its meta, taken before the stage ran (its rewrites erase the nodes they matched)."""
        for r in self.rewrites[since[0]:]:
            if not r.where:
                r.where = place_text([node_place(metas[n]) for n in r.nodes if n in metas])
        for s in self.skips[since[1]:]:
            if not s.where and s.node in metas:
                s.where = place_text([node_place(metas[s.node])])

    def rollback(self, n_rewrites: int, n_skips: int) -> None:
        """Forget what a stage recorded after the given counts (its graph was restored after an error)."""
        for r in self.rewrites[n_rewrites:]:
            _uncount(r.pattern)
        del self.rewrites[n_rewrites:], self.skips[n_skips:]

    def summary(self, stage: str) -> str:
        done = Counter(r.pattern for r in self.rewrites if r.stage == stage)
        left = sum(1 for s in self.skips if s.stage == stage)
        parts = ", ".join(f"{k} x{v}" for k, v in sorted(done.items())) or "no rewrites"
        err = f"; ERROR (fell back to Inductor): {self.errors[-1]}" if self.errors else ""
        return f"fusenorm [{self.graph_id}] {stage}: {parts}; {left} candidate(s) not rewritten{err}"

    # ---- output --------------------------------------------------------------------------------------
    def to_markdown(self) -> str:
        lines = [f"# fusenorm match report: graph {self.graph_id}", ""]
        if self.cache_hit:
            lines += ["## Served from Inductor's cache", "", _cache_hit_text(self.cache_hit), ""]
        lines += ["## Rewritten", ""]
        if not self.rewrites:
            lines.append("(none)")
        for r in self.rewrites:
            shapes = ", ".join(f"{k}={v}" for k, v in r.shapes.items())
            lines.append(
                f"- **{r.pattern}** ({r.stage})" + (f" at {r.where}" if r.where else "")
                + f": nodes {', '.join(r.nodes)}; {shapes}; dtype {r.dtype}; "
                f"kernel {r.kernel}" + (f"; {r.detail}" if r.detail else "") + _measured(r.measure_s)
            )
        # Each site not rewritten once, with every fusion's reason; a node another fusion rewrote is not listed.
        taken = {n for r in self.rewrites for n in r.nodes}
        sites: dict = {}
        for s in self.skips:
            if s.node not in taken:
                sites.setdefault(s.node, []).append(s)
        lines += ["", "## Seen, not rewritten", ""]
        if not sites:
            lines.append("(none)")
        for node, entries in sites.items():
            where = next((e.where for e in entries if e.where), "")
            reasons = "; ".join(f"{e.pattern} ({e.stage}): {e.reason}{_measured(e.measure_s)}" for e in entries)
            lines.append(f"- `{node}`" + (f" at {where}" if where else "") + f": {reasons}")
        if self.on_gpu:
            lines += ["", "## Would be rewritten on a GPU", ""] + [f"- {n}" for n in self.on_gpu]
        if self.notes:
            lines += ["", "## Notes", ""] + [f"- {n}" for n in self.notes]
        if self.errors:
            lines += ["", "## Errors (the graph was left to plain Inductor)", ""]
            lines += [f"- {e}" for e in self.errors]
        if self.dumps:
            lines += ["", "## Dumps (in this directory)", ""] + [f"- {name}" for name in sorted(self.dumps)]
        return "\n".join(lines) + "\n"

    def to_json(self) -> str:
        return json.dumps(
            {
                "graph_id": self.graph_id,
                "rewrites": [asdict(r) for r in self.rewrites],
                "skips": [asdict(s) for s in self.skips],
                "errors": self.errors,
                "notes": self.notes,
                "on_gpu": self.on_gpu,
                "dumps": sorted(self.dumps),
                "cache_hit": self.cache_hit,
            },
            indent=1,
        )

    def write(self) -> Optional[str]:
        """Write the report and the dumps under this run's folder in config.debug_dir (then the run's index);
        returns the graph's folder or None. Raises OSError where it cannot write safely (callers warn)."""
        if not config.debug_dir:
            return None
        _install_hooks()
        run = _current_run()
        name = self.graph_id.replace("/", "_")
        with run.open() as run_fd:
            if self._written_to is None or self._written_to[0] is not run:
                os.mkdir(name, 0o700, dir_fd=run_fd)  # fails if anything (a link included) is there
                with _open_dir(name, run_fd, where=run.path) as fd:
                    os.fchmod(fd, 0o700)
                    st = os.fstat(fd)
                self._written_to = (run, (st.st_dev, st.st_ino))
            with _open_dir(name, run_fd, where=run.path, expect=self._written_to[1]) as fd:
                for file_name, text in self.dumps.items():
                    _put(fd, file_name, text)
                _put(fd, "report.md", self.to_markdown())
                _put(fd, "report.json", self.to_json())
            run.graphs[self.graph_id] = {
                "graph_id": self.graph_id, "dir": name, "rewrites": len(self.rewrites), "skips": len(self.skips),
                "errors": len(self.errors), "cache_hit": self.cache_hit,
            }
            _put(run_fd, "index.md", run.index_markdown())
            _put(run_fd, "index.json", run.index_json())
        return os.path.join(run.path, name)


def _cache_hit_text(hits: dict[str, int]) -> str:
    counts = ", ".join(f"{k.replace('_', ' ')} cache hits: {v}" for k, v in sorted(hits.items()) if v)
    return (f"Inductor served this graph from its caches ({counts}). If it was compiled with fusenorm "
            f"(`backend=\"fusenorm\"` or `fusenorm_inductor.enable()`), fusenorm's fusion passes did not run for it "
            f"in this process: the cached code runs what the compile that filled the cache fused, and none of that "
            f"is listed below. Set `TORCHINDUCTOR_FORCE_DISABLE_CACHES=1` to recompile every graph and get full "
            f"reports.")


# ---- writing without following links -------------------------------------------------------------------

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


@contextlib.contextmanager
def _open_dir(name: str, dir_fd: Optional[int] = None, *, where: str = "", expect: Optional[tuple] = None
              ) -> Iterator[int]:
    """An fd of directory ``name`` (relative to ``dir_fd``), refusing a symbolic link (``O_NOFOLLOW``) and,
    with ``expect``, any directory but the one of that (st_dev, st_ino)."""
    if not (_O_NOFOLLOW and _O_DIRECTORY and os.open in os.supports_dir_fd):
        raise OSError("fusenorm's debug dumps need O_NOFOLLOW and dir_fd support (a POSIX system)")
    path = os.path.join(where, name)
    if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
        raise OSError(f"{path} is a symbolic link: fusenorm writes its debug dumps only into real directories")
    fd = os.open(name, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=dir_fd)
    try:
        if expect is not None:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != expect:
                raise OSError(f"{path} was replaced since fusenorm created it; not writing there")
        yield fd
    finally:
        os.close(fd)


def _put(dir_fd: int, name: str, text: str) -> None:
    """Write file ``name`` in the directory ``dir_fd``: a new file (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode
    0600) renamed over the old one, so a link there is neither followed nor written through."""
    try:
        if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            raise OSError(f"{name} is a symbolic link: fusenorm does not write through links")
    except FileNotFoundError:
        pass
    tmp = f".{name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        with open(fd, "w", encoding="utf-8", closefd=False) as f:
            f.write(text)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        os.unlink(tmp, dir_fd=dir_fd)
        raise


@contextlib.contextmanager
def _open_path(path: str) -> Iterator[int]:
    """An fd of the absolute directory ``path``, reached one component at a time from ``/`` without following
    any symbolic link (a link anywhere on the path is refused, naming it: a ``debug_dir`` under a linked folder
    would land in the link's target); missing components are created with mode 0700."""
    parts = [p for p in path.split(os.sep) if p]
    fd = os.open(os.sep, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    try:
        where = os.sep
        for part in parts:
            try:
                os.mkdir(part, 0o700, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                with _open_dir(part, fd, where=where) as child:
                    nxt = os.dup(child)
            except OSError as e:
                if "symbolic link" in str(e):
                    raise OSError(f"{os.path.join(where, part)} is a symbolic link and lies on the debug_dir path "
                                  f"{path}: fusenorm writes its debug dumps only through real directories (set "
                                  f"debug_dir to the resolved path, {os.path.realpath(path)}, to write there)") from None
                raise
            os.close(fd)
            fd, where = nxt, os.path.join(where, part)
        yield fd
    finally:
        os.close(fd)


class _Run:
    """This process's folder under one debug_dir: ``run-<time>-<pid>-<random>``, created new (``mkdir``
    fails on anything already there), mode 0700."""

    def __init__(self, base: str) -> None:
        self.base, self.pid, self.started = base, os.getpid(), time.time()
        self.graphs: dict[str, dict] = {}
        created = not os.path.lexists(base)
        with _open_path(base) as base_fd:  # refuses a debug_dir with a symbolic link anywhere on its path
            if created:
                os.fchmod(base_fd, 0o700)
            for _ in range(16):
                stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.started))
                self.name = f"run-{stamp}-{self.pid}-{secrets.token_hex(4)}"
                try:
                    os.mkdir(self.name, 0o700, dir_fd=base_fd)
                    break
                except FileExistsError:
                    continue
            else:
                raise FileExistsError(f"no fresh run folder could be created in {base}")
            with _open_dir(self.name, base_fd, where=base) as fd:
                os.fchmod(fd, 0o700)
                st = os.fstat(fd)
        self.id = (st.st_dev, st.st_ino)
        self.path = os.path.join(base, self.name)

    @contextlib.contextmanager
    def open(self) -> Iterator[int]:
        """An fd of the run folder, checked to be the one created (through no link)."""
        with _open_path(self.base) as base_fd, _open_dir(self.name, base_fd, where=self.base, expect=self.id) as fd:
            yield fd

    def index_json(self) -> str:
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.started))
        return json.dumps({"pid": self.pid, "started": started, "graphs": list(self.graphs.values())}, indent=1)

    def index_markdown(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        lines = [f"# fusenorm debug run: process {self.pid}, started {when}", "",
                 "Graphs whose reports were written in this run, one folder each:", "",
                 "| graph | rewritten | not rewritten | errors | note |", "|---|---|---|---|---|"]
        for g in self.graphs.values():
            note = "served from Inductor's cache: fusenorm's passes did not run" if g["cache_hit"] else ""
            lines.append(f"| [{g['graph_id']}]({g['dir']}/report.md) | {g['rewrites']} | {g['skips']} | "
                         f"{g['errors']} | {note} |")
        lines += ["", "A graph Inductor serves from its caches (AOTAutograd / FX graph cache) is not recompiled, so "
                  "fusenorm's passes do not run for it and its report lists nothing; run with "
                  "`TORCHINDUCTOR_FORCE_DISABLE_CACHES=1` to recompile every graph and get full reports."]
        return "\n".join(lines) + "\n"


_run: Optional[_Run] = None


def _current_run() -> _Run:
    """This process's run folder under config.debug_dir, created at the first write (and anew after
    ``clear()``, a change of debug_dir, or a fork)."""
    global _run
    base = os.path.abspath(os.path.expanduser(config.debug_dir))
    if _run is None or _run.base != base or _run.pid != os.getpid():
        _run = _Run(base)
    return _run


_current: Optional[GraphReport] = None
_history: list[GraphReport] = []


def _compile_id() -> str:
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
    except Exception:  # not inside a Dynamo compile (e.g. compile_fx called directly)
        cid = None
    return str(cid) if cid is not None else "nocompileid"


def for_stage(stage: str) -> GraphReport:
    """The report of the graph being compiled: a new one at the pre-grad stage or on a new compile id."""
    global _current
    cid = _compile_id()
    _install_hooks()
    if _current is None or stage == "pre_grad" or not _current.graph_id.endswith(f"_{cid}"):
        if stage == "pre_grad" and _current is not None and _current.graph_id.endswith(f"_{cid}") and \
                all(e.stage == "pre_grad" for e in _current.rewrites + _current.skips) and _current in _history:
            # The pre-grad pass again for the same compile, the last one never reaching the joint graph: Dynamo
            # restarted the compile (a dynamic-shape trace that specializes a float, such as a norm's eps) and
            # the first attempt's graph is gone; its report would list sites of a graph that never runs.
            _history.remove(_current)
            _current.rollback(0, 0)
            if _current._written_to is not None:  # its folder stays; the run's index, rewritten next, drops it
                _current._written_to[0].graphs.pop(_current.graph_id, None)
        _current = _new_report(cid)
    return _current


def _new_report(cid: str) -> GraphReport:
    global _made
    rep = GraphReport(graph_id=f"{next(_seq):03d}_{cid}")
    _history.append(rep)
    del _history[:-64]  # keep the last few for inspection; this is a debugging aid, not a log
    _made += 1
    return rep


# ---- graphs served from Inductor's caches ----------------------------------------------------------------
# On a cache hit Inductor does not run the custom passes, so nothing above is called. Dynamo's compile
# start/end callbacks see every frame compile: one whose AOTAutograd cache hits rose while it ran gets a report
# saying so (from torch 2.13 the pre-grad pass runs after the cache lookup, so no report exists for it; up to
# torch 2.12 the pre-grad pass ran before it, and its report is the one marked). torch._dynamo.reset() drops
# the callbacks; they are installed again at the next pass run, write or clear().

_made = 0  # reports created by for_stage so far
_compile_start: Optional[tuple] = None  # (compile id, cache hits, _made) at the start of the current compile


def _cache_hits() -> tuple[int, int]:
    return (counters.get("aot_autograd", {}).get("autograd_cache_hit", 0),
            counters.get("inductor", {}).get("fxgraph_cache_hit", 0))


def _on_compile_start(args: Any) -> None:
    global _compile_start
    _compile_start = (str(args.compile_id), _cache_hits(), _made)


def _on_compile_end(args: Any) -> None:
    global _compile_start
    start, _compile_start = _compile_start, None
    if start is None or start[0] != str(args.compile_id):
        return
    aot, fx = (max(0, now - before) for now, before in zip(_cache_hits(), start[1]))
    if not aot:
        return
    try:
        _note_cache_hit(start[0], {"aot_autograd": aot, "fx_graph": fx}, _made - start[2])
    except Exception as e:  # as the passes' debugging aids: a failure here never fails the compile
        if not config.fallback_on_error:
            raise
        warnings.warn(f"fusenorm: the cache-hit report was not written ({type(e).__name__}: {e}); the compile goes on")


def _note_cache_hit(cid: str, hits: dict[str, int], made: int) -> None:
    recent = _history[max(0, len(_history) - made):] if made else []  # the reports made during this compile
    rep = next((r for r in reversed(recent) if r.graph_id.endswith(f"_{cid}")), None)
    if rep is None:  # also without a debug_dir: last_report() answers for a graph served from the cache
        rep = _new_report(cid)
    log.info("fusenorm [%s] served from Inductor's cache (AOTAutograd cache hits: %d, FX graph cache hits: %d): "
             "fusenorm's passes did not run", rep.graph_id, hits["aot_autograd"], hits["fx_graph"])
    rep.cache_hit = hits
    rep.write()


def _install_hooks() -> None:
    """Register the compile callbacks with Dynamo (again after a ``torch._dynamo.reset()``, which drops them)."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # a torch without compile callbacks: cache hits go unreported
        return
    if _on_compile_start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_on_compile_start)
    if _on_compile_end not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(_on_compile_end)


@contextlib.contextmanager
def aside() -> Iterator[list[GraphReport]]:
    """A compile made inside another compile's pass (a decision compiling the fused side of its own site, to
    time it) keeps its reports and counters to itself: the list this yields gets the reports made inside the
    block; after it, the outer compile's current report, the history and torch's counters (fusenorm's, Dynamo's
    frame and graph counts a user's test may check, the cache-hit counts the outer compile's end callback
    reads) are as they were."""
    global _current, _made
    saved = (_current, list(_history), _made, {k: dict(v) for k, v in counters.items()})
    made: list[GraphReport] = []
    try:
        yield made
    finally:
        made.extend(r for r in _history if all(r is not s for s in saved[1]))
        _current, _made = saved[0], saved[2]
        _history[:] = saved[1]
        for k in set(counters) | set(saved[3]):  # in place: code holding a counter keeps counting into it
            counters[k].clear()
            counters[k].update(saved[3].get(k, {}))


def reports() -> list[GraphReport]:
    """Reports of the graphs compiled recently in this process (newest last)."""
    return list(_history)


def _measured(seconds: float) -> str:
    return f" (measured in {seconds:.2f} s)" if seconds >= 0.005 else ""


def last_report() -> Optional[GraphReport]:
    """The match report of the graph compiled last in this process (None before any): what fusenorm rewrote,
    what it saw and left to Inductor and why; ``.to_markdown()`` and ``.to_json()`` render it."""
    return _history[-1] if _history else None


def clear() -> None:
    """Forget the reports; the next write starts a new run folder."""
    global _current, _run
    _current = None
    _run = None
    _history.clear()
    _install_hooks()


_install_hooks()


# ----------------------------------------------------------------------------------------------------------
# Accounting over many graphs' reports (examples, benchmarks): which norm sites were fused, which not and why
# ----------------------------------------------------------------------------------------------------------


_FWD_SITE_PATTERNS = ("linear_norm_fwd", "norm_linear_fwd", "deferred_norm")


def summarize(reports) -> dict:
    """Norm sites of the compiled graphs and what became of each.

    A norm site is a norm that fusenorm canonicalized (``canonical_*``), or put back as written because no
    fusion would take it (``norm_prospects``, which says why). The attention patterns take two norms
    each at the pre-grad stage; every other canonical norm reaches the joint graph, where ``linear_norm_fwd``
    looks at every norm (so each gets a rewrite or a reason) and ``norm_linear_fwd`` at those left. The
    summary lists per site: "fused" (pattern names) or the reasons given; ``unaccounted`` counts canonical
    norms with neither (should be 0). Backward (``dgrad_norm_bwd``) and other patterns are counted apart.
    """
    n_canonical = 0
    rewrites: Counter = Counter()
    sites: dict[str, dict] = {}
    other_skips: Counter = Counter()
    backward = {"fused": 0, "unfused": Counter()}
    errors: list[str] = []

    def site(graph_id: str, node: str) -> dict:
        return sites.setdefault(f"{graph_id}:{node}", {"fused": [], "reasons": []})

    for rep in reports:
        errors += [f"{rep.graph_id}: {e}" for e in rep.errors]
        for r in rep.rewrites:
            if r.pattern.startswith("canonical_"):
                n_canonical += 1
                continue
            rewrites[r.pattern] += 1
            if r.pattern.startswith("attention_block"):
                for node in r.nodes[:2]:  # the LayerNorm and the RMSNorm of the block
                    site(rep.graph_id, node)["fused"].append(r.pattern)
            elif r.pattern in _FWD_SITE_PATTERNS:
                site(rep.graph_id, r.nodes[0])["fused"].append(r.pattern)
            elif r.pattern == "dgrad_norm_bwd":
                backward["fused"] += 1
        for s in rep.skips:
            if s.pattern == "norm_prospects":
                # A canonical norm put back as written: a site left unfused; its reasons come as the forward
                # patterns' skips of the same node.
                n_canonical += 1
                site(rep.graph_id, s.node)
            elif s.pattern in _FWD_SITE_PATTERNS:
                site(rep.graph_id, s.node)["reasons"].append(f"{s.pattern}: {s.reason}")
            elif s.pattern == "dgrad_norm_bwd":
                backward["unfused"][s.reason] += 1
            else:
                other_skips[f"{s.pattern}: {s.reason}"] += 1
    fused = {k: v for k, v in sites.items() if v["fused"]}
    unfused = {k: v for k, v in sites.items() if not v["fused"]}
    unfused_reasons: Counter = Counter()
    for v in unfused.values():
        unfused_reasons[" | ".join(v["reasons"]) or "(no reason reported)"] += 1
    return {
        "graphs": len(reports),
        "norm_sites": n_canonical,
        "fused_sites": len(fused),
        "unfused_sites": len(unfused),
        "unaccounted_sites": max(0, n_canonical - len(sites)),
        "rewrites": dict(sorted(rewrites.items())),
        "fused_by": dict(Counter(p for v in fused.values() for p in dict.fromkeys(v["fused"]))),
        "unfused_reasons": dict(unfused_reasons.most_common()),
        "backward": {"fused": backward["fused"], "unfused": dict(backward["unfused"].most_common())},
        "other_skips": dict(other_skips.most_common()),
        "errors": errors,
    }


def format_summary(s: dict) -> str:
    """The report summary as a few readable lines."""
    lines = [f"norm sites: {s['norm_sites']} in {s['graphs']} graph(s); fused {s['fused_sites']}"
             f" ({', '.join(f'{k} x{v}' for k, v in s['fused_by'].items()) or '-'}), unfused {s['unfused_sites']}"
             + (f", UNACCOUNTED {s['unaccounted_sites']}" if s["unaccounted_sites"] else "")]
    for reason, n in s["unfused_reasons"].items():
        lines.append(f"  unfused x{n}: {reason}")
    bw = s["backward"]
    lines.append(f"backward (dgrad_norm_bwd): fused {bw['fused']}"
                 + "".join(f"\n  unfused x{n}: {r}" for r, n in bw["unfused"].items()))
    for reason, n in s["other_skips"].items():
        lines.append(f"  seen, not rewritten x{n}: {reason}")
    for e in s["errors"]:
        lines.append(f"ERROR (graph left to Inductor): {e}")
    return "\n".join(lines)
