"""tuning/measure.py's cache and probes, and the fuse decisions (tuning/decide.py, the pre-norm's in
tuning/norm_mm.py), when something is wrong (issue 16), on CPU.

A malformed cache file or entry counts as absent and warns once per file; an unwritable cache directory warns
once; a failed copy-bandwidth probe is not remembered, divides nothing by zero and leaves the fuse decision
unmeasured; deterministic mode times nothing. CUDA paths are simulated with fake keys, a fake device tag and
a patched ``_can_measure`` / ``_time_ms``.
"""

import json
import warnings

import pytest
import torch

from fusenorm_inductor import config
from fusenorm_inductor.tuning import decide as tuning, measure
from fusenorm_inductor.tuning import norm_mm as norm_mm_tuning
from fusenorm_inductor.kernels.triton.common import GemmConfig

CUDA = torch.device("cuda")  # only a key and a branch here: nothing runs on it
C0 = GemmConfig("row", 64, 64, 64, 3, 4)
C1 = GemmConfig("coop", 128, 128, 64, 2, 8, 2, True)


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    measure.clear_memory()
    monkeypatch.setattr(measure, "_device_tag", lambda device: f"fake {device}")  # no CUDA needed for keys
    with config.patch({"tuning.cache_dir": str(tmp_path)}):
        yield
    measure.clear_memory()


def _key(name="k"):
    return ("mm_norm", CUDA, ((8, 8), (8, 1), "torch.bfloat16"), name)


def _entry(cfg=C1, t_fused=1.0, t_unfused=2.0):
    return {"config": list(cfg), "t_fused_ms": t_fused, "t_unfused_ms": t_unfused, "candidates": {}}


def _cache_path(tmp_path):
    return tmp_path / f"tuning-v{measure.CACHE_VERSION}.json"


def _fusenorm_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("fusenorm:")]


def _no_measure():
    pytest.fail("measured")


# ----------------------------------------------------------------------------------------------------------
# 1. Malformed files and entries
# ----------------------------------------------------------------------------------------------------------

BAD_FILES = {
    "list": ("[]", "not a JSON object but list"),
    "null": ("null", "not a JSON object but NoneType"),
    "number": ("3", "not a JSON object but int"),
    "string": ('"x"', "not a JSON object but str"),
    "truncated": ('{"a": ', "not valid JSON"),
    "garbage": ("\x00\x01 not json", "not valid JSON"),
    "not-utf8": (b"\xff\xfe{}", "cannot be read"),
}


@pytest.mark.parametrize("content, problem", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_malformed_file_is_absent_and_warns_once(tmp_path, monkeypatch, content, problem):
    path = _cache_path(tmp_path)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.warns(UserWarning) as record:
        assert measure.lookup(_key("a")) is None
        assert measure.lookup(_key("b")) is None  # another key reads the file again: no second warning
    msgs = _fusenorm_warnings(record)
    assert len(msgs) == 1 and str(path) in msgs[0] and problem in msgs[0], msgs
    assert "\n" not in msgs[0]
    # The launcher's runtime lookup falls back to the first candidate (a launch never measures)...
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert measure.tuned_config(_key("c"), CUDA, lambda: [C0, C1]) == C0
    # ... and a measurement stored by a decision replaces the bad file with a valid one holding it.
    measure.store(_key("d"), _entry(C1))
    assert measure.tuned_config(_key("d"), CUDA, lambda: [C0, C1]) == C1
    assert list(json.loads(path.read_text()).values()) == [_entry(C1)]


def test_malformed_file_decision_measures_again(tmp_path, monkeypatch):
    """The compile-time decision on a malformed file: measured afresh, no exception."""
    _cache_path(tmp_path).write_text("[]")
    monkeypatch.setattr(measure, "can_measure", lambda device: True)
    with pytest.warns(UserWarning, match="not a JSON object"):
        choice = tuning._choice(_key(), CUDA, lambda: _entry(C1, 1.0, 2.0), lambda: "default")
    assert choice.fuse and choice.config == C1.label() and choice.t_fused_ms == 1.0


BAD_ENTRIES = {
    "list": ([], "not an object"),
    "null": (None, "not an object"),
    "no-config": ({"t_fused_ms": 1.0, "t_unfused_ms": 2.0}, "'config' is None"),
    "no-times": ({"config": list(C1)}, "'t_fused_ms' is None"),
    "time-str": ({**_entry(), "t_unfused_ms": "2"}, "'t_unfused_ms' is '2'"),
    "time-nan": ({**_entry(), "t_fused_ms": float("nan")}, "'t_fused_ms' is nan"),
    "config-str": ({**_entry(), "config": "row"}, "not a list"),
    "config-short": ({**_entry(), "config": ["row", 64, 64]}, "has 3 fields"),
    "config-long": ({**_entry(), "config": [*C1, 1]}, "has 10 fields"),
    "config-types": ({**_entry(), "config": ["row", "64", 64, 64, 3, 4]}, "block_m = '64'"),
    "config-zero": ({**_entry(), "config": ["row", 64, 0, 64, 3, 4]}, "block_n = 0"),
    "config-kind": ({**_entry(), "config": [7, 64, 64, 64, 3, 4]}, "kind = 7"),
    "config-prefetch": ({**_entry(), "config": ["row", 64, 64, 64, 3, 4, 1, "yes"]}, "prefetch = 'yes'"),
    "config-stats-regs": ({**_entry(), "config": ["gl_pp", 128, 128, 64, 5, 4, 1, False, 1]}, "stats_regs = 1"),
}


@pytest.mark.parametrize("entry, problem", BAD_ENTRIES.values(), ids=BAD_ENTRIES.keys())
def test_malformed_entry_is_absent(tmp_path, monkeypatch, entry, problem):
    path = _cache_path(tmp_path)
    good = measure._disk_key(_key("good"))
    path.write_text(json.dumps({measure._disk_key(_key()): entry, good: _entry(C1)}))
    # The launcher's lookup: the first candidate, with one warning naming the file and the problem.
    with pytest.warns(UserWarning) as record:
        assert measure.tuned_config(_key(), CUDA, lambda: [C0, C1]) == C0
        assert measure.lookup(_key()) is None
    msgs = _fusenorm_warnings(record)
    assert len(msgs) == 1 and str(path) in msgs[0] and problem in msgs[0], msgs
    assert measure.lookup(_key("good")) == _entry(C1)  # the file's other entries still count
    # The compile-time decision measures that shape again and stores a valid entry over the bad one.
    monkeypatch.setattr(measure, "can_measure", lambda device: True)
    choice = tuning._choice(_key(), CUDA, lambda: _entry(C1, 1.0, 2.0), lambda: "default")
    assert choice.fuse and choice.t_fused_ms == 1.0 and choice.config == C1.label()
    data = json.loads(path.read_text())
    assert data[measure._disk_key(_key())] == _entry(C1, 1.0, 2.0) and data[good] == _entry(C1)


def test_malformed_warns_once_per_file(tmp_path):
    """Two bad entries in one file warn once; the same problems in another cache directory warn again."""
    bad = {measure._disk_key(_key(k)): {"config": "x"} for k in "ab"}
    for d in ("one", "two"):
        (tmp_path / d).mkdir()
        _cache_path(tmp_path / d).write_text(json.dumps(bad))
    with pytest.warns(UserWarning) as record:
        for d in ("one", "two"):
            with config.patch({"tuning.cache_dir": str(tmp_path / d)}):
                assert measure.lookup(_key("a")) is None and measure.lookup(_key("b")) is None
            measure._misses.clear()
    msgs = _fusenorm_warnings(record)
    assert len(msgs) == 2 and str(tmp_path / "one") in msgs[0] and str(tmp_path / "two") in msgs[1], msgs


def test_valid_cache_does_not_warn(tmp_path):
    """Round trip with a config with all its fields: no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        measure.store(_key(), _entry(C1, 3.0, 2.0))
        measure.clear_memory()
        assert measure.tuned_config(_key(), CUDA, lambda: [C0, C1]) == C1


# ----------------------------------------------------------------------------------------------------------
# 2. Unwritable cache directories and failing writes
# ----------------------------------------------------------------------------------------------------------


def test_unwritable_cache_dir_warns_once(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # a file where the directory should be (chmod does not stop root)
    with config.patch({"tuning.cache_dir": str(blocker)}):
        with pytest.warns(UserWarning) as record:
            measure.store(_key("a"), _entry(C0))
            measure.store(_key("b"), _entry(C1))
        msgs = _fusenorm_warnings(record)
        assert len(msgs) == 1 and str(blocker) in msgs[0] and "cannot write" in msgs[0], msgs
        # The measurements are still used in this process.
        assert measure.tuned_config(_key("b"), CUDA, lambda: [C0, C1]) == C1


@pytest.mark.parametrize("fail", ["replace", "dump"])
def test_failing_write_warns_and_cleans_up(tmp_path, monkeypatch, fail):
    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    if fail == "replace":
        monkeypatch.setattr(measure.os, "replace", boom)
    else:
        monkeypatch.setattr(measure.json, "dump", boom)
    with pytest.warns(UserWarning) as record:
        measure.store(_key(), _entry(C0))
    msgs = _fusenorm_warnings(record)
    assert len(msgs) == 1 and str(tmp_path) in msgs[0] and "No space left" in msgs[0], msgs
    # No temporary file left behind, no cache file (the writers' lock file stays: it holds no data).
    assert [p.name for p in tmp_path.iterdir()] in ([], [f"tuning-v{measure.CACHE_VERSION}.json.lock"])
    assert measure.lookup(_key()) == _entry(C0)


# ----------------------------------------------------------------------------------------------------------
# 3. A failed copy-bandwidth probe
# ----------------------------------------------------------------------------------------------------------


class _FakeCopyKernel:
    """Stands in for the Triton copy kernel (no 256 MiB copy on CPU); fails while ``broken``."""

    broken = True

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if _FakeCopyKernel.broken:
                raise RuntimeError("out of resources: shared memory\nsecond line")

        return launch


def _fake_time(fn, give_up_ms=None):
    """The real ``_time_ms``'s contract: inf when fn fails, else a time (1 ms)."""
    try:
        fn()
    except Exception:  # noqa: BLE001
        return float("inf")
    return 1.0


@pytest.fixture
def broken_probe(monkeypatch):
    _FakeCopyKernel.broken = True
    monkeypatch.setattr(measure, "_copy_kernel", _FakeCopyKernel)
    monkeypatch.setattr(measure, "time_ms", _fake_time)
    monkeypatch.setattr(measure, "can_measure", lambda device: True)
    with config.patch({"tuning.measure_inductor": False}):  # the unfused side is the probe's estimate
        yield _FakeCopyKernel


def test_failed_probe_is_not_memoized(broken_probe):
    dev = torch.device("cpu")
    with pytest.warns(UserWarning) as record:
        assert measure.copy_bandwidth_gbps(dev) == 0.0
        assert measure.copy_bandwidth_gbps(dev) == 0.0
        assert measure.norm_proxy_ms(4096, 256, torch.bfloat16, 2, dev) is None  # no ZeroDivisionError
    msgs = _fusenorm_warnings(record)
    assert len(msgs) == 1 and "copy-bandwidth probe on cpu failed" in msgs[0] and "\n" not in msgs[0], msgs
    assert "the timed copy kernel failed" in msgs[0]
    assert ("copy_gbps", dev) not in measure._memo
    broken_probe.broken = False  # the next call probes again and succeeds: 2 x 256 MiB in 1 ms
    assert measure.copy_bandwidth_gbps(dev) == pytest.approx(2 * (1 << 28) / 1e6)
    assert measure._memo[("copy_gbps", dev)]


def test_probed_bandwidth_is_kept_on_disk(broken_probe, tmp_path):
    """A later process whose decisions are cached does not probe again (the probe compiles and times a kernel
    in its first step): the bandwidth is read from the tuning cache. A failed probe stores nothing, and a
    stored value that is not a bandwidth is probed over."""
    dev = torch.device("cpu")
    with pytest.warns(UserWarning, match="probe on cpu failed"):
        assert measure.copy_bandwidth_gbps(dev) == 0.0
    assert not _cache_path(tmp_path).exists()
    broken_probe.broken = False
    gbps = measure.copy_bandwidth_gbps(dev)
    assert gbps == pytest.approx(2 * (1 << 28) / 1e6)
    measure.clear_memory()  # a new process: only the file is left
    broken_probe.broken = True  # a probe now would fail: 0.0 and a warning
    assert measure.copy_bandwidth_gbps(dev) == gbps
    path = _cache_path(tmp_path)
    disk_key = measure._disk_key(("copy_gbps", dev))
    for bad in (-1.0, 0, "fast", True, None, [1.0]):
        data = json.loads(path.read_text())
        data[disk_key] = {"gbps": bad}
        path.write_text(json.dumps(data))
        measure.clear_memory()
        with pytest.warns(UserWarning, match="probe on cpu failed"):
            assert measure.copy_bandwidth_gbps(dev) == 0.0, bad


def test_probe_that_raises(monkeypatch):
    """An exception outside the timer (allocating the buffers on a full GPU) is a failed probe too."""

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch, "empty", oom)
    with pytest.warns(UserWarning, match="probe on cpu failed .*OutOfMemoryError"):
        assert measure.copy_bandwidth_gbps(torch.device("cpu")) == 0.0
    assert ("copy_gbps", torch.device("cpu")) not in measure._memo


def _prenorm_args():
    """Where the kernels run: on a GPU machine Triton compiles for CUDA, so CPU tensors would make every
    candidate fail (the interpreter serves the CPU only where there is no GPU)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a, w = (torch.randn(65, 40, dtype=torch.float16, device=dev), torch.randn(24, 40, dtype=torch.float16, device=dev))
    return (a, w.t(), None, torch.ones(40, device=dev), None, 1e-5, False, torch.float16)


def test_failed_probe_leaves_decision_unmeasured(tmp_path, broken_probe):
    """The measurement runs (the kernels' configs are timed), the unfused time is unknown: the match is fused,
    the reason says why, nothing is written to disk; once the probe works the shape is measured in full. The
    unfused side is the probe's estimate here: Inductor's own code, timed on a GPU, needs no probe (and its
    entry is complete, so it is written)."""
    args = _prenorm_args()
    with pytest.warns(UserWarning, match="copy-bandwidth probe"):
        choice = norm_mm_tuning.prenorm_choice(*args)
    assert choice.fuse and choice.t_fused_ms is None and choice.t_unfused_ms is None, choice
    assert "copy-bandwidth probe failed" in choice.reason
    assert not _cache_path(tmp_path).exists()
    # The launcher uses the measured config without measuring again.
    key = norm_mm_tuning.prenorm_key(*args[:5], args[6], args[7])
    assert measure.lookup(key)["t_unfused_ms"] is None
    assert norm_mm_tuning.prenorm_norm_ms(args[0]) == 0.0
    broken_probe.broken = False
    again = norm_mm_tuning.prenorm_choice(*args)
    assert again.t_fused_ms == 1.0 and again.t_unfused_ms > 1.0 and "(measured 1 ms fused" in again.reason, again
    assert measure._disk_key(key) in json.loads(_cache_path(tmp_path).read_text())


def test_failed_probe_with_cached_entry(broken_probe):
    """A cached pre-norm measurement does not need the probe, but the pattern weighs fan-out with
    prenorm_norm_ms: with the probe failing the match counts as not measured and nothing divides by zero."""
    args = _prenorm_args()
    key = norm_mm_tuning.prenorm_key(*args[:5], args[6], args[7])
    measure.store(key, _entry(C0, 1.0, 3.0))
    with pytest.warns(UserWarning, match="copy-bandwidth probe"):
        choice = norm_mm_tuning.prenorm_choice(*args)
        assert norm_mm_tuning.prenorm_norm_ms(args[0]) == 0.0
    assert choice.fuse and choice.t_fused_ms is None and "copy-bandwidth probe failed" in choice.reason
    # The forward and backward decisions read only their cached entry.
    fkey = _key("fwd")
    measure.store(fkey, _entry(C1, 1.0, 3.0))
    assert tuning._choice(fkey, CUDA, _no_measure, lambda: "default").t_fused_ms == 1.0


def test_failed_probe_compiles(broken_probe):
    """norm -> linear compiled with measuring on (simulated on CPU) and the probe failing: fused, no error."""
    from torch._dynamo.utils import counters

    model = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Linear(32, 24))
    x = torch.randn(33, 32)
    with pytest.warns(UserWarning, match="copy-bandwidth probe"):
        out = torch.compile(model, backend="fusenorm")(x)
    torch.testing.assert_close(out, model(x), atol=1e-4, rtol=1e-4)
    assert "norm_linear_fwd" in counters["fusenorm"]


# ----------------------------------------------------------------------------------------------------------
# 4. Deterministic mode
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture
def deterministic(monkeypatch):
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    monkeypatch.setattr(measure, "can_measure", lambda device: True)
    monkeypatch.setattr(measure, "time_ms", lambda fn, give_up_ms=None: pytest.fail("timed in deterministic mode"))
    yield
    torch.use_deterministic_algorithms(before, warn_only=warn_only)


def test_deterministic_config_is_first_candidate(deterministic):
    """Neither measured nor read from the cache: a cached choice would make the kernel depend on the machine's
    history."""
    measure.store(_key(), _entry(C1))
    assert measure.tuned_config(_key(), CUDA, lambda: [C0, C1]) == C0
    assert measure.tuned_config(_key("new"), CUDA, lambda: [C0, C1]) == C0


def test_deterministic_choice_is_not_measured(deterministic):
    measure.store(_key(), _entry(C1, 5.0, 1.0))  # cached: fusion loses; not used either
    for key in (_key(), _key("new")):
        choice = tuning._choice(key, CUDA, _no_measure, lambda: "the kernels' first candidate")
        assert choice.fuse and choice.t_fused_ms is None and choice.config == "the kernels' first candidate"
        assert "deterministic" in choice.reason and choice.reason.startswith("fused (not measured"), choice
    choice = norm_mm_tuning.prenorm_choice(*_prenorm_args())
    assert choice.fuse and choice.t_fused_ms is None and "deterministic" in choice.reason, choice


def test_host_times_are_taken_without_garbage_collection_and_restore_it(monkeypatch):
    """A collection landing in a timed loop would charge its pause to the calls (timeit's practice): the loops
    run with the collector off, and it is back on afterwards, also when the timed function fails."""
    import gc

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    seen = []

    def fn():
        seen.append(gc.isenabled())

    assert gc.isenabled()
    t = measure.host_us(fn, calls=4, repeats=3)
    assert t is not None and t >= 0
    assert seen[0] is True and seen[1:] == [False] * 12, seen
    assert gc.isenabled()

    def failing():
        if len(seen) > 13:
            raise RuntimeError("boom")
        seen.append(gc.isenabled())

    assert measure.host_us(failing, calls=4, repeats=3) is None
    assert gc.isenabled()
