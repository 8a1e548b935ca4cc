"""``python -m fusenorm_inductor.kernels.hopper.offline``: compile every Gluon kernel variant the dispatch can
launch for sm_90a without a GPU (cpu_compile.py): what the CPU test suite and CI run, since Gluon has no
interpreter. Reports registers, spills and shared memory."""

from __future__ import annotations

import os

from . import deferred_mm, gdpa, mm_norm, mm_norm_backward, norm_mm

_OPS = {"mm_norm_backward": mm_norm_backward, "norm_mm": norm_mm, "gdpa": gdpa, "deferred_mm": deferred_mm}  # else mm_norm


def _compile_one(v: dict) -> dict:
    try:
        c = _OPS.get(v.get("op"), mm_norm).compile_variant(v)
        return dict(v, ok=True, triton=_triton_version(), registers=c.registers, spill_bytes=c.spill_bytes, shared=c.shared,
                    cluster_barrier="barrier.cluster.arrive" in c.ptx and "barrier.cluster.wait" in c.ptx)
    except Exception as e:  # noqa: BLE001 - reported per variant
        root = e
        while root.__cause__ is not None:  # a CompilationError's text is the kernel source; the cause says why
            root = root.__cause__
        return dict(v, ok=False, triton=_triton_version(), error=f"{type(root).__name__}: {str(root)[-1500:]} (in {type(e).__name__}: "
                                       f"{str(e)[-500:]})")


def _triton_version() -> str:
    import triton

    return triton.__version__


def variants() -> list[dict]:
    """Every variant the dispatch can launch: ``offline_variants`` of mm_norm, mm_norm_backward, norm_mm, gdpa
    and deferred_mm, in that order."""
    return (mm_norm.offline_variants() + mm_norm_backward.offline_variants() + norm_mm.offline_variants()
            + gdpa.offline_variants() + deferred_mm.offline_variants())


def serve(stdin, stdout) -> None:
    """A compile worker for a caller that schedules the variants itself (the CPU test suite compiles them beside
    its other tests, with this triton and a newer one): prints ``{"variants": [...]}`` on one line, then for each
    line read (a variant, as JSON) its result on one line, until stdin ends."""
    import json

    print(json.dumps({"variants": variants()}), file=stdout, flush=True)
    for line in stdin:
        if line.strip():
            print(json.dumps(_compile_one(json.loads(line))), file=stdout, flush=True)


def main(argv=None) -> int:
    """``python -m fusenorm_inductor.kernels.hopper.offline [--jobs J]``: compile every variant the dispatch
    can launch (``variants``) for sm_90a and print one JSON object per line. Must run without TRITON_INTERPRET
    (the interpreter replaces the jit functions the compiler needs)."""
    import argparse
    import json
    import sys
    from concurrent.futures import ProcessPoolExecutor

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--op", default=None, help="only this op's variants (mm_norm, mm_norm_backward, norm_mm, gdpa, deferred_mm)")
    p.add_argument("--serve", action="store_true", help="compile the variants read from stdin, one JSON object a "
                   "line, after printing the list of all (``serve``); --jobs and --op do not apply")
    p.add_argument("--nice", type=int, default=0, help="lower this process's priority by this much (a worker "
                   "compiling beside a test run leaves the tests their core)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("unset TRITON_INTERPRET: the sm_90 compile needs the real compiler")
    if args.nice:
        os.nice(args.nice)
    if args.serve:
        serve(sys.stdin, sys.stdout)
        return 0
    todo = variants()
    if args.op is not None:
        todo = [v for v in todo if v.get("op", "mm_norm") == args.op]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for res in pool.map(_compile_one, todo):
            print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
