"""Shared test setup.

- Inductor's graph caches are off (its FX graph cache, AOTAutograd's, and Dynamo's profile-guided dynamic
  shapes from earlier runs): on a cache hit custom passes do not run, so counters and reports would be empty and
  a test could pass without compiling anything. The compiled-kernel caches stay on, in this session's own
  directory: a kernel whose source an earlier test compiled is loaded instead of compiled again (a hit there
  skips the C++ compiler, never a pass). Environment variables, so subprocesses inherit them.
- Kernel tuning does not measure (config.tuning.measure off): every match is fused with the kernels' first
  candidate, so the small test shapes are fused and checked; test_tuning.py turns it on where it tests it.
  The tuning cache is this run's own directory.
- Without CUDA, Triton kernels are tested in the interpreter (TRITON_INTERPRET must be set before any
  kernel module is imported).
"""

import atexit
import os
import shutil
import tempfile

from . import CACHES_OFF

for _name, _value in CACHES_OFF.items():
    os.environ.setdefault(_name, _value)
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fusenorm-tests-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
# The CPU runs check the rewritten graphs: fusenorm's reference ops in them (by default a CPU graph is Inductor's).
os.environ.setdefault("FUSENORM_CPU_REFERENCE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fusenorm_inductor  # noqa: E402
from fusenorm_inductor import config  # noqa: E402


@pytest.fixture(scope="session")
def _tuning_cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("fusenorm-tuning"))


@pytest.fixture(autouse=True)
def _fresh_compile_state(_tuning_cache_dir):
    """Each test compiles from scratch, with fusenorm's counters and reports empty, and errors raised. What
    tests measure (a fake timer's verdicts, a fake bandwidth) is stored in this run's own tuning cache, never in
    the user's (a later real run on the same machine would read it)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    fusenorm_inductor.report.clear()
    with config.patch({"fallback_on_error": False, "tuning.measure": False,
                       "tuning.cache_dir": config.tuning.cache_dir or _tuning_cache_dir}):
        yield
    torch._dynamo.reset()


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture
def cpu_step_timer(monkeypatch):
    """``baseline.time_training_steps`` without a GPU timer: both sides are compiled as the decision compiles
    them and run one training step on the CPU, and every output and gradient of the fused side must equal
    the unfused side's; the "times" are (1.0, 2.0). Yields the ``what`` of each call."""
    from fusenorm_inductor.tuning import baseline

    calls = []

    def steps(build_fused, build_unfused, inputs, what):
        runs = []
        for build in (build_fused, build_unfused):
            leaves, wants = baseline._leaves(inputs)
            outs = build(leaves)(*leaves)
            outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
            grads = torch.autograd.grad(outs, wants, [torch.ones_like(o) for o in outs])
            runs.append(outs + list(grads))
        assert len(runs[0]) == len(runs[1]) > 2
        for f, u in zip(*runs):
            torch.testing.assert_close(f, u, rtol=1e-3, atol=1e-3)
        calls.append(what)
        return 1.0, 2.0

    monkeypatch.setattr(baseline, "time_training_steps", steps)
    yield calls


# ---- the sm_90a compile of the Gluon variants, beside the other tests (offline_compile.py) --------------------


def pytest_configure(config):
    config.addinivalue_line("markers", "offline_compile: checks the sm_90a compiles of offline_compile.py's pool "
                                       "(runs after the other tests, while the pool compiles beside them)")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The tests that wait for the pool's compiles run last, in their order: the compiles fill the cores the
    other tests leave idle, and by then most are done."""
    late = [item for item in items if item.get_closest_marker("offline_compile")]
    if late:
        items[:] = [item for item in items if not item.get_closest_marker("offline_compile")] + late


def pytest_collection_finish(session):
    if session.config.option.collectonly or not any(
            item.get_closest_marker("offline_compile") for item in session.items):
        return
    from fusenorm_inductor.kernels.hopper import _compat

    if _compat.available():  # else test_gluon_compile.py is skipped
        from . import offline_compile

        offline_compile.pool()


def pytest_sessionfinish(session):
    from . import offline_compile

    offline_compile.close()
