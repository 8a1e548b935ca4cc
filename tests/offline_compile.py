"""The sm_90a compile of every Gluon variant (kernels/hopper/offline.py), run beside the rest of the test session.

Gluon has no interpreter, so the CPU suite compiles each variant the dispatch can launch with ``triton.compile``
for a CUDA target, with this interpreter's triton and with each one in TRITON_NEXT_PYTHON. Those compiles are
most of the suite's CPU time, while the other tests use about one core: conftest.py starts this pool when the
session has collected tests that read its results (marked ``offline_compile``, run last), so the compiles fill
the cores the other tests leave idle.

The pool keeps ``jobs`` worker processes (``offline --serve``, without TRITON_INTERPRET, at a lower priority than
the tests), each serving one interpreter at a time; the workers take the variants in order, those of the
first interpreter first, so the tests that wait for them pass in the order they run. Identical variants compile
once: triton's kernel cache holds the first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from typing import Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The interpreters to compile with: this one (the triton the package runs with here) and, from
# TRITON_NEXT_PYTHON (os.pathsep-separated), others with a newer triton (CI sets up the newest one: the
# Gluon API moves between releases, and kernels/hopper/_compat.py absorbs it).
PYTHONS = [sys.executable] + [p for p in os.environ.get("TRITON_NEXT_PYTHON", "").split(os.pathsep) if p]

# What one test waits at most for the results it checks (the whole compile took this long with one worker).
TIMEOUT_S = 2400


def python_id(python: str) -> str:
    return "this-python" if python == sys.executable else python


def default_jobs() -> int:
    """Workers: one per core up to 4 (CI's machine has 2: both compile while the other tests wait on I/O and
    child compilers, and the tests keep their core by priority)."""
    return max(1, min(4, os.cpu_count() or 1))


class _Worker:
    def __init__(self, python: str):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join([ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # today's default; triton >= 3.9 warns when it is unset
        self.python = python
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [python, "-m", "fusenorm_inductor.kernels.hopper.offline", "--serve", "--nice", "10"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True, env=env, cwd=ROOT)

    def read(self) -> Optional[dict]:
        """The next JSON object the worker prints (None when it exits first)."""
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        return None

    def compile(self, variant: dict) -> Optional[dict]:
        try:
            self.proc.stdin.write(json.dumps(variant) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        return self.read()

    def why_dead(self) -> str:
        self.close()
        self.stderr.seek(0)
        return f"the compile worker ({self.python}) exited with {self.proc.returncode}: {self.stderr.read()[-3000:]}"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class CompilePool:
    """Compiles every variant of each interpreter in ``pythons`` on ``jobs`` workers; ``variants`` and
    ``results`` wait for what a test checks."""

    def __init__(self, pythons: list, jobs: int):
        self.pythons, self.jobs = list(pythons), jobs
        self._lock = threading.Condition()
        self._variants = {p: None for p in self.pythons}  # the interpreter's list, once a worker printed it
        self._failed = {p: None for p in self.pythons}  # why the interpreter's workers could not start
        self._todo = {p: deque() for p in self.pythons}
        self._results = {p: {} for p in self.pythons}  # variant index -> its result
        self._closing = False
        self._threads = [threading.Thread(target=self._slot, daemon=True, name=f"gluon-compile-{i}")
                         for i in range(jobs)]
        self._workers: list = []

    def start(self) -> "CompilePool":
        for t in self._threads:
            t.start()
        return self

    def close(self) -> None:
        with self._lock:
            self._closing = True
            for p in self.pythons:
                self._todo[p].clear()
            workers = list(self._workers)
            self._lock.notify_all()
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
        for t in self._threads:
            t.join(timeout=5)

    # -- what tests wait for -------------------------------------------------------------------------------

    def _wait(self, ready, what: str):
        deadline = time.monotonic() + TIMEOUT_S
        with self._lock:
            while True:
                got = ready()
                if got is not None:
                    return got
                left = deadline - time.monotonic()
                if left <= 0 or self._closing:
                    raise TimeoutError(f"{what}: not compiled within {TIMEOUT_S} s")
                self._lock.wait(timeout=min(left, 10))

    def variants(self, python: str) -> list:
        """The interpreter's variants (offline.variants() there), in the order they compile."""

        def ready():
            if self._failed[python] is not None:
                raise RuntimeError(self._failed[python])
            return self._variants[python]

        return self._wait(ready, python)

    def results(self, python: str, indices) -> list:
        """The results of these variants of the interpreter (offline._compile_one's dicts)."""
        indices = list(indices)
        self.variants(python)

        def ready():
            done = self._results[python]
            return [done[i] for i in indices] if all(i in done for i in indices) else None

        return self._wait(ready, f"{python}: {len(indices)} variants")

    # -- the workers ---------------------------------------------------------------------------------------

    def _next(self):
        """(python, index) of the next variant to compile, (python, None) where that interpreter's list is not
        known yet (the slot's new worker prints it), or None when nothing is left."""
        with self._lock:
            if self._closing:
                return None
            for p in self.pythons:
                if self._failed[p] is not None:
                    continue
                if self._variants[p] is None:
                    return p, None
                if self._todo[p]:
                    return p, self._todo[p].popleft()
            return None

    def _start_worker(self, python: str) -> Optional[_Worker]:
        worker = _Worker(python)
        with self._lock:
            self._workers.append(worker)
        first = worker.read()
        with self._lock:
            if first is None or "variants" not in first:
                why = worker.why_dead() if first is None else f"{python}: unexpected first line {first!r:.300}"
                self._failed[python] = why
                self._lock.notify_all()
                return None
            if self._variants[python] is None:
                self._variants[python] = first["variants"]
                self._todo[python].extend(range(len(first["variants"])))
                self._lock.notify_all()
            elif self._variants[python] != first["variants"]:
                self._failed[python] = f"{python}: two workers listed different variants"
                self._lock.notify_all()
                return None
        return worker

    def _slot(self) -> None:
        worker: Optional[_Worker] = None
        try:
            while True:
                task = self._next()
                if task is None:
                    return
                python, index = task
                if worker is None or worker.python != python:
                    if worker is not None:
                        worker.close()
                    worker = self._start_worker(python)
                    if worker is None:
                        continue
                    if index is None:
                        continue
                elif index is None:
                    continue
                variant = self._variants[python][index]
                result = worker.compile(variant)
                if result is None:  # the worker died on this variant: its error is the result, and a new worker
                    result = dict(variant, ok=False, triton="?", error=worker.why_dead())
                    worker = None
                with self._lock:
                    self._results[python][index] = result
                    self._lock.notify_all()
        finally:
            if worker is not None:
                worker.close()


_POOL: Optional[CompilePool] = None


def pool(start: bool = True) -> Optional[CompilePool]:
    """This session's pool (started on the first call)."""
    global _POOL
    if _POOL is None and start:
        _POOL = CompilePool(PYTHONS, default_jobs()).start()
    return _POOL


def close() -> None:
    global _POOL
    if _POOL is not None:
        _POOL.close()
        _POOL = None
