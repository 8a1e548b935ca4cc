"""The default mode's decisions (tuning/table.py, decide._table_choice): read from a table of measured points,
no timing; which mode decides how (measure.decisions); the table's entries never reach the disk cache.

A synthetic table stands in for the shipped one (its points are arithmetic, so the interpolation is checked
exactly); the device is the CPU, with the table lookup patched to answer for it.
"""

import json

import pytest
import torch

from fusenorm_inductor import config
from fusenorm_inductor.tuning import decide, measure, table

CPU = torch.device("cpu")
CTX = ("ieee", "default", "")
CFG = ["gl_pp", 128, 128, 64, 5, 4, 1, False, False]


def spec(m, k):
    return ((("rows", m), k), (k, 1), "torch.bfloat16")


def key(m, k=512, eps=1e-5):
    return ("mm_norm", CPU, spec(m, k), ((k, 256), (1, k), "torch.bfloat16"), None, eps, True)


def point(m, t_f, t_u, k=512, **more):
    sig, mm = table.signature((*key(m, k)[2:], *CTX))
    assert mm == m
    return {"signature": sig, "M": m, "t_fused_ms": t_f, "t_unfused_ms": t_u, "config": CFG, **more}


@pytest.fixture
def tabled(monkeypatch):
    """Decisions in table mode on the CPU, from the points the test gives ``use``; nothing timed."""
    state = {"stored": {}}

    def use(*points):
        by_sig: dict = {}
        for p in points:
            by_sig.setdefault(p["signature"], []).append(p)
        for v in by_sig.values():
            v.sort(key=lambda p: p["M"])
        state["table"] = {"family": "h100", "gpu": "H100 (test)", "by_signature": by_sig, "copy_gbps": 3000.0}

    monkeypatch.setattr(table, "table_for", lambda device: state.get("table"))
    monkeypatch.setattr(measure, "decisions", lambda device: "table")
    monkeypatch.setattr(measure, "_context", lambda: CTX)
    monkeypatch.setattr(measure, "lookup", lambda k: state["stored"].get(k))
    monkeypatch.setattr(measure, "store", lambda k, e, bucket=False: state["stored"].__setitem__(k, e))
    monkeypatch.setattr(measure, "host_counts", lambda: False)
    state["use"] = use
    return state


def never(*_a, **_k):
    raise AssertionError("the default mode measured something")


def test_signature_drops_the_row_count_and_eps():
    a, m = table.signature((*key(4096, eps=1e-5)[2:], *CTX))
    b, m2 = table.signature((*key(8192, eps=1e-6)[2:], *CTX))
    assert (m, m2) == (4096, 8192) and a == b
    assert table.signature((*key(4096, k=1024)[2:], *CTX))[0] != a  # another width: another signature
    assert table.signature(measure.bucket_key(key(4096))[2:]) == (None, None)  # a bucket key has no exact M
    two = ("x", CPU, spec(4096, 512), spec(8192, 512))
    assert table.signature(two[2:]) == (None, None)  # two different row counts
    # the cache's JSON form of a key gives the same signature as the key itself
    disk = json.loads(json.dumps([*key(4096)[2:], *CTX], default=str))
    assert table.signature(disk) == (a, 4096)


def test_times_between_two_measured_rows_are_interpolated_as_a_power_of_m(tabled):
    tabled["use"](point(1000, 1.0, 2.0), point(8000, 8.0, 12.0))
    (lo, hi, est), why = table.lookup(key(2000), CPU, CTX)
    assert why == "" and (lo["M"], hi["M"]) == (1000, 8000)
    assert est["t_fused_ms"] == pytest.approx(2.0)  # t ~ M^1 between 1 and 8 ms
    # the unfused side has its own exponent: 2 ms at M = 1000 to 12 at 8000
    s = (torch.log(torch.tensor(6.0)) / torch.log(torch.tensor(8.0))).item()
    assert est["t_unfused_ms"] == pytest.approx(2.0 * 2 ** s, rel=1e-6)
    (lo, hi, est), _ = table.lookup(key(1 << 20), CPU, CTX)  # above the largest: the largest point holds
    assert lo is hi and lo["M"] == 8000 and est["t_fused_ms"] == pytest.approx(8.0)
    assert table.lookup(key(999), CPU, CTX)[0] is None  # below the smallest: no answer
    pts, why = table.lookup(key(2000, k=1024), CPU, CTX)
    assert pts is None and "these widths" in why


def test_fused_only_where_both_neighbours_and_the_estimate_win(tabled):
    tabled["use"](point(1000, 1.0, 2.0), point(8000, 8.0, 16.0))
    choice, entry = decide._table_choice(key(2000), CPU, "Inductor", None)
    assert choice.fuse and "estimated from the h100 table" in choice.reason and choice.config == "gl_pp 128x128x64 s5 w4"
    assert entry["unfused_by"] == decide.TABLE and tabled["stored"][key(2000)] is entry  # for the launches
    tabled["stored"].clear()
    tabled["use"](point(1000, 1.0, 2.0), point(8000, 8.0, 8.1))  # the larger neighbour did not win
    choice, _ = decide._table_choice(key(1100), CPU, "Inductor", None)  # the estimate wins
    assert not choice.fuse and "did not win" in choice.reason, choice


def test_unknown_gpu_or_shape_is_left_to_inductor_and_says_why(tabled):
    choice, entry = decide._table_choice(key(2000), CPU, "Inductor", None)  # no table at all
    assert not choice.fuse and entry is None and "no decision table" in choice.reason
    assert "max-autotune" in choice.reason
    tabled["use"](point(1000, 1.0, 2.0))
    choice, _ = decide._table_choice(key(2000, k=2048), CPU, "Inductor", None)
    assert not choice.fuse and "no measured point" in choice.reason


def test_the_default_mode_never_measures(tabled, monkeypatch):
    tabled["use"](point(1000, 1.0, 2.0, t_fused_step_ms=3.0, t_unfused_step_ms=4.0), point(8000, 8.0, 16.0))
    monkeypatch.setattr(measure, "can_measure", lambda device: False)
    forward = decide._choice(key(1000), torch.device("cuda"), never, lambda: "first", step_fn=never)
    assert forward.fuse and "estimated from the table: the training step" in forward.reason, forward
    tabled["stored"].clear()
    # a point without training-step times: a training graph is not fused from its forward alone
    step = decide._choice(key(8000), torch.device("cuda"), never, lambda: "first", step_fn=never)
    assert not step.fuse and "no times in the table" in step.reason, step


def test_host_bound_sites_are_judged_as_the_measured_decision_judges_them(tabled, monkeypatch):
    """A site whose kernels are shorter than their launches (the chain at d = 256, M = 32768 on the H100): the
    unfused side costs at least the bare GEMM call plus one launch (38 us there), not the compiled subgraph's
    dearer call; without that floor the table fused a site its measurement had declined (0.65x of Inductor)."""
    monkeypatch.setattr(measure, "host_counts", lambda: True)
    monkeypatch.setattr(measure, "unfused_host_us", lambda device: 38.0)
    tabled["use"](point(32768, 0.1161, 0.0765, h_fused_us=58.0, h_unfused_us=100.0, unfused_by="inductor"))
    choice, _ = decide._table_choice(key(32768), CPU, "Inductor", None)
    assert not choice.fuse and "host 58 us fused vs 38 us unfused" in choice.reason, choice
    monkeypatch.setattr(measure, "unfused_host_us", lambda device: None)  # the probe failed: the entry's own
    tabled["stored"].clear()
    choice, _ = decide._table_choice(key(32768), CPU, "Inductor", None)
    assert choice.fuse and "vs 100 us unfused" in choice.reason, choice


def test_a_measured_entry_in_the_cache_decides_before_the_table(tabled):
    tabled["use"](point(1000, 1.0, 2.0), point(8000, 8.0, 16.0))
    tabled["stored"][key(2000)] = {"config": CFG, "t_fused_ms": 3.0, "t_unfused_ms": 2.0, "unfused_by": "inductor"}
    choice, _ = decide._table_choice(key(2000), CPU, "Inductor", None)
    assert not choice.fuse and "(measured 3 ms" in choice.reason


def test_mode_decides_how_a_match_is_decided(monkeypatch):
    import torch._inductor.config as inductor_config

    cuda = torch.device("cuda")
    assert measure.decisions(CPU) == "reference"
    with config.patch({"tuning.measure": None}):
        assert measure.decisions(cuda) == "table"
        with inductor_config.patch(max_autotune=True):
            assert measure.decisions(cuda) == "measure"
        with inductor_config.patch(max_autotune_gemm=True):
            assert measure.decisions(cuda) == "measure"
    with config.patch({"tuning.measure": True}):
        assert measure.decisions(cuda) == "measure"
    with config.patch({"tuning.measure": False}), inductor_config.patch(max_autotune=True):
        assert measure.decisions(cuda) == "fuse"


def test_table_entries_never_reach_the_disk(monkeypatch):
    written = []
    monkeypatch.setattr(measure, "_write_disk", lambda k, e: written.append(k))
    measure.store(("t", CPU, 1), {"config": CFG, "t_fused_ms": 1.0, "t_unfused_ms": 2.0, "unfused_by": "table"})
    assert written == []
    measure.store(("t", CPU, 2), {"config": CFG, "t_fused_ms": 1.0, "t_unfused_ms": 2.0, "unfused_by": "inductor"})
    assert len(written) == 1


def test_the_copy_bandwidth_comes_from_the_table(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(measure, "decisions", lambda device: "table")
    monkeypatch.setattr(table, "copy_gbps", lambda device: 1234.0)
    monkeypatch.setattr(measure, "_read_disk", never)  # neither the cache nor a probe
    assert measure.copy_bandwidth_gbps(cuda) == 1234.0


def test_work_outside_the_fused_kernel_is_charged_to_it():
    won = decide.Choice(True, "gl_pp 128x128x64 s5 w4", "fused (measured ...)", 0.42, 0.54)
    lost = decide.charged(won, 0.27, "gelu reads the norm's output")
    assert not lost.fuse and lost.t_fused_ms == pytest.approx(0.69) and "gelu" in lost.reason
    kept = decide.charged(won, 0.01, "gelu reads the norm's output")
    assert kept.fuse  # 0.43 < 0.54 x 0.85
    assert not decide.charged(won, None, "x").fuse  # unknown cost: not fused


def test_consumers_read_statistics_in_the_layout_the_rewrite_makes():
    from fusenorm_inductor.tuning.deferred_norm import stats_tile, x_tile

    assert x_tile(768, has_producer=False) == 768  # the aten row reduction: one tile of the whole row
    assert x_tile(768, has_producer=True) == stats_tile(768)


def test_shipped_tables_load_and_answer_their_own_points(monkeypatch):
    """Every shipped table parses, and each point answers itself (the lookup finds its own signature and M)."""
    files = sorted(table.TABLES.glob("*.json")) if table.TABLES.is_dir() else []
    for path in files:
        data = json.loads(path.read_text())
        assert data["version"] == table.TABLE_VERSION and data["gpu"] and data["date"], path
        loaded = table._load(path.stem)
        monkeypatch.setattr(table, "table_for", lambda device, loaded=loaded: loaded)
        for p in data["points"][:50]:
            sig = json.loads(p["signature"])
            ctx = tuple(sig[-3:])

            def sub(v):
                if isinstance(v, list):
                    return ("rows", p["M"]) if v == ["rows", "M"] else tuple(sub(x) for x in v)
                return v

            k = (p["kind"], CPU, *sub(sig)[:-3])
            (lo, hi, est), why = table.lookup(k, CPU, ctx)
            assert lo["M"] == p["M"] and est["t_fused_ms"] == pytest.approx(p["t_fused_ms"]), (path, p)


def test_a_tabled_deferred_site_keeps_each_gemms_configuration_for_its_launch(monkeypatch):
    """The table names each GEMM's configuration by label (``gemm_labels``); the decision keeps it under the key
    the launch will look up (the consumers read x's statistics in the layout the rewrite makes), or declines
    when a label is not a candidate of that GEMM."""
    from fusenorm_inductor.kernels import deferred as d
    from fusenorm_inductor.tuning import deferred_norm as tuning

    stored = {}
    monkeypatch.setattr(measure, "store", lambda k, e, bucket=False: stored.__setitem__(k, e))
    monkeypatch.setattr(tuning, "deferred_candidates", lambda *a, **k: [_Cfg("A"), _Cfg("B")])
    m, k, n, n2 = 257, 96, 384, 40
    x = torch.randn(m, n)
    producer = (torch.randn(m, k), torch.randn(k, n))
    site = tuning.Site(x, producer, [(torch.randn(n, n2), None)], torch.randn(n), None, 1e-5, d.LN, wgrads=0,
                       cache=False)
    assert tuning._keep_table_configs(site, ["A", "B"]) is None
    calls = tuning._gemm_calls(site, real=False)
    keys = [tuning.deferred_key(*c[:7], c[8], c[10], c[11], c[13]) for c in calls]
    assert [stored[kk]["config"] for kk in keys] == [["A"], ["B"]] and len(stored) == 2
    assert all(e["unfused_by"] == decide.TABLE for e in stored.values())
    assert calls[1][4].shape == d.stats_shape(m, n, d.LN, tuning.stats_tile(n))  # the producer's tiles
    assert "not a candidate" in tuning._keep_table_configs(site, ["A", "C"])
    assert "each GEMM" in tuning._keep_table_configs(site, ["A"])
    lone = tuning.Site(x, None, [(torch.randn(n, n2), None)], torch.randn(n), None, 1e-5, d.LN, wgrads=0, cache=False)
    (call,) = tuning._gemm_calls(lone, real=False)
    assert call[4].shape == d.stats_shape(m, n, d.LN, n) and call[9] == n  # whole-row statistics, as rewritten


class _Cfg(tuple):
    """A configuration stand-in: its label and its fields (the list a cache entry stores)."""

    def __new__(cls, name):
        return super().__new__(cls, (name,))

    def label(self):
        return self[0]


def test_a_launch_finds_its_configuration_outside_the_compiles_mode_and_process(monkeypatch):
    """Launches run after the compile, where Inductor's config is the default again: a configuration decided
    under max-autotune is found all the same; and in the default mode a process that loaded the compiled
    graph from Inductor's cache (no decision made here) asks the table."""
    import torch._inductor.config as inductor_config

    cuda = torch.device("cuda")
    k = ("mm_norm", cuda, spec(4096, 512), ((512, 256), (1, 512), "torch.bfloat16"), None, 1e-5, True)
    first = [_Cfg("first")]
    monkeypatch.setattr(measure, "config_of", lambda e: _Cfg(e["config"][0]))
    monkeypatch.setattr(measure, "_read_disk", lambda: {})
    monkeypatch.setattr(measure, "_write_disk", lambda *a: None)
    monkeypatch.setattr(measure, "_device_tag", lambda device: "a GPU")
    measure.clear_memory()
    try:
        with inductor_config.patch(max_autotune=True):
            measure.store(k, {"config": ["tuned"], "t_fused_ms": 1.0, "t_unfused_ms": 2.0, "unfused_by": "inductor"})
        assert measure.tuned_config(k, cuda, lambda: first).label() == "tuned"
        measure.clear_memory()
        monkeypatch.setattr(measure, "decisions", lambda device: "table")
        monkeypatch.setattr(table, "lookup", lambda key, device, ctx: ([None, None, {"config": ["tabled"]}], ""))
        assert measure.tuned_config(k, cuda, lambda: first).label() == "tabled"
        monkeypatch.setattr(measure, "decisions", lambda device: "measure")
        assert measure.tuned_config(k, cuda, lambda: first).label() == "first"
    finally:
        measure.clear_memory()


def test_the_default_mode_takes_the_bare_pairs_host_time_from_the_table(monkeypatch):
    """No host probe in the default mode: the floor the table's points were judged with comes with the table."""
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(measure, "decisions", lambda device: "table")
    monkeypatch.setattr(table, "table_for", lambda device: {"unfused_host_us": 42.5})
    monkeypatch.setattr(measure, "host_us", lambda *a, **k: pytest.fail("the default mode timed the host"))
    assert measure.unfused_host_us(dev) == 42.5


def test_the_table_builder_keeps_the_lower_host_time_of_two_runs():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "build_decision_table.py"
    spec = importlib.util.spec_from_file_location("build_decision_table", path)
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    new = [{"signature": "s", "M": 8, "config": ["a"], "h_fused_us": 90.0, "h_unfused_us": 60.0},
           {"signature": "s", "M": 16, "config": ["a"], "h_fused_us": 50.0, "h_unfused_us": 40.0},
           {"signature": "t", "M": 8, "config": ["a"], "h_fused_us": 70.0}]
    old = [{"signature": "s", "M": 8, "config": ["a"], "h_fused_us": 49.0, "h_unfused_us": 70.0},
           {"signature": "s", "M": 16, "config": ["b"], "h_fused_us": 10.0, "h_unfused_us": 30.0}]
    assert builder.lower_host_times(new, old) == 2
    assert (new[0]["h_fused_us"], new[0]["h_unfused_us"]) == (49.0, 60.0)
    assert (new[1]["h_fused_us"], new[1]["h_unfused_us"]) == (50.0, 30.0)  # another kernel: its own host time
    assert new[2]["h_fused_us"] == 70.0
