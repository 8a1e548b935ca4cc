"""The tuning cache under real use: concurrent processes lose nothing, a failed measurement is never
persisted, and the file is strict JSON. (Malformed files and entries: test_tuning_cache.py.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fusenorm_inductor import config
from fusenorm_inductor.kernels.triton.common import GemmConfig
from fusenorm_inductor.tuning import measure

CUDA = torch.device("cuda")  # only a key here: nothing runs on it
C1 = GemmConfig("coop", 128, 128, 64, 2, 8, 2, True)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    measure.clear_memory()
    monkeypatch.setattr(measure, "_device_tag", lambda device: f"fake {device}")
    with config.patch({"tuning.cache_dir": str(tmp_path)}):
        yield
    measure.clear_memory()


def _key(name: str):
    return ("mm_norm", CUDA, ((8, 8), (8, 1), "torch.bfloat16"), name)


def _entry(t_fused=1.0, t_unfused=2.0, candidates=None):
    return {"config": list(C1), "t_fused_ms": t_fused, "t_unfused_ms": t_unfused,
            "candidates": candidates if candidates is not None else {C1.label(): t_fused}}


def _strict(text: str):
    """json.loads refusing Infinity / NaN (what other JSON readers refuse)."""
    def bad(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=bad)


_WRITER = textwrap.dedent(
    """
    import sys, torch
    from fusenorm_inductor import config
    from fusenorm_inductor.kernels.triton.common import GemmConfig
    from fusenorm_inductor.tuning import measure
    measure._device_tag = lambda device: "fake " + str(device)
    config.tuning.cache_dir = sys.argv[1]
    cfg = GemmConfig("row", 64, 64, 64, 3, 4)
    for i in range(int(sys.argv[3])):
        key = ("mm_norm", torch.device("cuda"), ((8, 8), (8, 1), "torch.bfloat16"), sys.argv[2], i)
        measure.store(key, {"config": list(cfg), "t_fused_ms": 1.0, "t_unfused_ms": 2.0, "candidates": {}})
    """
)


def test_concurrent_processes_lose_no_entry(tmp_path):
    """Six processes storing 40 entries each at the same time: all 240 are in the file afterwards (each store
    reads, merges and replaces the file: unlocked, the processes overwrote each other's entries)."""
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), f"p{i}", "40"], cwd=ROOT,
                              stderr=subprocess.PIPE, text=True) for i in range(6)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    data = _strict((tmp_path / f"tuning-v{measure.CACHE_VERSION}.json").read_text())
    assert len(data) == 240


def test_a_failed_measurement_is_kept_in_this_process_only(tmp_path):
    """An entry with an inf time (a candidate or the unfused side raised, e.g. after a transient CUDA error)
    serves this process but is not written: the next process measures again instead of keeping the shape
    unfused until the sources change."""
    measure.store(_key("ok"), _entry())
    for name, entry in {"fused": _entry(t_fused=math.inf), "unfused": _entry(t_unfused=math.inf),
                        "candidate": _entry(candidates={"a": 1.0, "b": math.inf})}.items():
        measure.store(_key(name), entry)
        assert measure.lookup(_key(name)) is entry  # this process still uses it
    data = _strict((tmp_path / f"tuning-v{measure.CACHE_VERSION}.json").read_text())
    assert list(data) == [measure._disk_key(_key("ok"))]
    measure.clear_memory()
    assert measure.lookup(_key("fused")) is None and measure.lookup(_key("ok")) is not None


def test_an_infinite_entry_on_disk_counts_as_absent(tmp_path):
    """A file written by an earlier version (``Infinity`` as a time) is re-measured, not trusted."""
    path = tmp_path / f"tuning-v{measure.CACHE_VERSION}.json"
    text = json.dumps({measure._disk_key(_key("old")): _entry(t_fused=123.5)})
    path.write_text(text.replace("123.5", "Infinity"))
    with pytest.warns(UserWarning, match="'t_fused_ms' is inf"):
        assert measure.lookup(_key("old")) is None


def test_time_ms_survives_a_sticky_error(monkeypatch):
    """A candidate that raises, and a synchronize that raises again after it (a sticky CUDA error): inf, not
    an exception out of the tuner."""
    def boom():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", boom)
    assert measure.time_ms(boom) == math.inf


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bandwidth_probe_gives_its_memory_back():
    """The probe used to keep 2 x 1 GiB reserved in the caching allocator after a compile."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    measure.clear_memory()
    assert measure.copy_bandwidth_gbps(CUDA) > 100
    assert torch.cuda.memory_reserved() <= before + (64 << 20)


def test_keys_carry_tf32_and_the_inductor_mode(monkeypatch):
    """A measurement made with TF32 off, or under Inductor's default mode, does not answer for TF32 on or for
    max-autotune (both change the timed code: the kernels' and cuBLAS's fp32 GEMMs, Inductor's own code)."""
    import torch._inductor.config as inductor_config

    from fusenorm_inductor.kernels.triton import common

    monkeypatch.setattr(common, "_cuda_matmul_allows_tf32", lambda: False)
    measure.store(_key("k"), _entry())
    assert measure.lookup(_key("k")) is not None
    with inductor_config.patch(max_autotune=True):
        assert measure.lookup(_key("k")) is None
    monkeypatch.setattr(common, "_cuda_matmul_allows_tf32", lambda: True)
    assert measure.lookup(_key("k")) is None
    measure.clear_memory()
    monkeypatch.setattr(common, "_cuda_matmul_allows_tf32", lambda: False)
    assert measure.lookup(_key("k")) is not None  # and the disk cache keeps them apart the same way


# ---- no measurement inside a step: launches read what the compile decided, by bucket of M ------------------


def _rows_key(m: int):
    return ("mm_norm", CUDA, measure.spec(torch.empty(m, 64), rows=True), measure.spec(torch.empty(64, 32)), "x")


def test_a_launch_never_measures(monkeypatch):
    """A launch whose shape has no decision runs the first candidate: it used to measure right there, in the
    middle of the user's step (CUDA-graph captures, maybe a nested Inductor compile)."""
    monkeypatch.setattr(measure, "can_measure", lambda device: True)
    c0 = GemmConfig("row", 64, 64, 64, 3, 4)
    assert measure.tuned_config(_rows_key(300), CUDA, lambda: [c0, C1]) == c0
    assert measure.lookup(_rows_key(300)) is None  # nothing was measured or stored


def test_a_dynamic_m_decision_serves_its_bucket():
    """A decision made at one M (a dynamic-M graph's traced M) answers launches of the other M in its bucket
    (the next power of two), not those of another bucket, and a static shape keeps its own entry."""
    c0 = GemmConfig("row", 64, 64, 64, 3, 4)
    measure.store(_rows_key(300), _entry(), bucket=True)  # as tuning/decide.py stores a decision
    assert measure.tuned_config(_rows_key(300), CUDA, lambda: [c0, C1]) == C1
    assert measure.tuned_config(_rows_key(257), CUDA, lambda: [c0, C1]) == C1  # same bucket (512)
    assert measure.tuned_config(_rows_key(512), CUDA, lambda: [c0, C1]) == C1
    assert measure.tuned_config(_rows_key(513), CUDA, lambda: [c0, C1]) == c0  # the next bucket: no decision
    assert measure.tuned_config(_rows_key(256), CUDA, lambda: [c0, C1]) == c0
    assert measure.bucket_key(_rows_key(300)) == measure.bucket_key(_rows_key(400)) != _rows_key(300)
    assert measure.row_bucket(1) == 1 and measure.row_bucket(262144) == 262144 and measure.row_bucket(262145) == 524288


# ---- one decision for all ranks ------------------------------------------------------------------------------

_RANK = textwrap.dedent(
    """
    import json, os, sys, torch
    import torch.distributed as dist
    from fusenorm_inductor import config
    from fusenorm_inductor.tuning import measure
    measure._device_tag = lambda device: "fake " + str(device)
    rank = int(sys.argv[1])
    config.tuning.cache_dir = sys.argv[2] + f"/rank{rank}"  # each rank its own cache: they agree anyway
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2] + "/rendezvous", rank=rank, world_size=2)
    asked = []

    def decide():  # as tuning/decide.py's: the cache, else a measurement (each rank would measure another time)
        entry = measure.lookup(key)
        if entry is None:
            asked.append(rank)
            entry = {"config": ["row", 64, 64, 64, 3, 4], "t_fused_ms": 1.0 + rank, "t_unfused_ms": 2.0,
                     "candidates": {}}
            measure.store(key, entry, bucket=True)
        return entry

    key = ("mm_norm", torch.device("cuda"), (((("rows", 300)), 64), (64, 1), "torch.bfloat16"))
    got = [measure.agreed(key, decide) for _ in range(2)]
    print(json.dumps({"rank": rank, "got": [g["t_fused_ms"] for g in got], "asked": asked,
                      "kept": measure.lookup(key)["t_fused_ms"]}))
    dist.destroy_process_group()
    """
)


def test_ranks_agree_on_rank_0s_decision(tmp_path):
    """Under torch.distributed every rank gets rank 0's decision (rank 1 never measures) and keeps it."""
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(r), str(tmp_path)], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    out = []
    for p in procs:
        stdout, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    assert out[0] == {"rank": 0, "got": [1.0, 1.0], "asked": [0], "kept": 1.0}
    assert out[1] == {"rank": 1, "got": [1.0, 1.0], "asked": [], "kept": 1.0}
