"""Probe: the first training step (or inference call) of the MLP tower, compile and fusenorm's decisions
included, in this process, with a tuning cache the caller chooses: run it twice with the same
``FUSENORM_CACHE_DIR`` and the second run shows what a process with warm decision caches still measures.

The model is examples/train_mlp.py's (``--depth`` x Linear -> LayerNorm, BCE head), d = ``--d``, M = ``--rows``,
bf16, ``torch.compile(backend=...)`` as the examples compile it (graph caches off). Prints one line,
``RESULT {json}``: the first step's wall seconds, fusenorm's measuring time by part
(``tuning.measure.spent_seconds``), the patterns rewritten, and the tuner's expensive calls by caller
(count, seconds). ``FN_SRC`` (environment): a directory to import fusenorm_inductor from first (an older
tree, for a before / after). Do not profile it: cProfile slows the host path the decisions time (host cost per
call counts without CUDA graphs), and they then fuse less.

    for tag in cold warm; do FUSENORM_CACHE_DIR=/tmp/fn python benchmarks/probes/probe_first_step.py \\
        --d 512 --backend fusenorm --tag $tag; done
    python benchmarks/probes/probe_first_step.py --d 512 --backend inductor --tag inductor

Result (2026-12-06, an H100): benchmarks/results/first_step_cache_h100.json; docs/history/performance-log.md, "The first
step with warm decision caches".
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.environ.get("FN_SRC", ROOT), ROOT, os.path.join(ROOT, "examples")]

import torch  # noqa: E402

import _common  # noqa: E402  (examples/_common.py)
import train_mlp  # noqa: E402

import fusenorm_inductor  # noqa: E402
from fusenorm_inductor.tuning import baseline, measure  # noqa: E402

MEASURE_CALLS = ("time_ms", "time_candidates", "compile_ahead", "copy_bandwidth_gbps", "host_us", "gemm_ms",
                 "norm_proxy_ms", "fused_host_us", "unfused_host_us")
BASELINE_CALLS = ("compile_unfused", "compile_fused", "time_compiled", "time_training_steps")


def count_calls(log: dict) -> None:
    """Wrap the tuner's expensive calls: log["name <- caller"] = [calls, seconds]."""
    for module, names in ((measure, MEASURE_CALLS), (baseline, BASELINE_CALLS)):
        for name in names:
            if not hasattr(module, name):
                continue

            def wrapped(*args, _f=getattr(module, name), _name=name, **kw):
                frames = traceback.extract_stack(limit=4)[:-1]
                who = "/".join(f"{os.path.basename(s.filename)}:{s.name}" for s in frames[-2:])
                t0 = time.perf_counter()
                try:
                    return _f(*args, **kw)
                finally:
                    entry = log[f"{_name} <- {who}"]
                    entry[0] += 1
                    entry[1] += time.perf_counter() - t0

            setattr(module, name, wrapped)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=int, default=512, help="the tower's width")
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--rows", type=int, default=262144)
    p.add_argument("--backend", default="fusenorm", choices=("fusenorm", "inductor"))
    p.add_argument("--mode", default="train", choices=("train", "infer"))
    p.add_argument("--tag", default="", help="a label copied into the result")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    log: dict = collections.defaultdict(lambda: [0, 0.0])
    count_calls(log)
    dev, dtype = "cuda", torch.bfloat16
    torch.manual_seed(0)
    model = train_mlp.MLP(a.d, a.d, a.depth).to(dev, dtype)
    batch = train_mlp.make_batches(a.rows, a.d, 1, dev, dtype)[0]
    _common.warm_up_compiler(dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with _common.no_graph_caches():
        compiled = _common.compile_model(model, a.backend)
        if a.mode == "train":
            _common.train_step(compiled, _common.make_optimizer(compiled, 1e-3, dev), batch, train_mlp.bce_loss)
        else:
            with torch.inference_mode():
                compiled(batch[0])
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    out = {"tag": a.tag, "d": a.d, "backend": a.backend, "mode": a.mode, "first_s": round(wall, 3),
           "spent": {k: round(v, 3) for k, v in measure.spent_seconds().items()},
           "fused": sorted({w.pattern for r in fusenorm_inductor.reports() for w in (r.rewrites or [])}),
           "calls": {k: [n, round(s, 3)] for k, (n, s) in sorted(log.items(), key=lambda kv: -kv[1][1])},
           "source": os.environ.get("FN_SRC", "this tree")}
    print("RESULT " + json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
