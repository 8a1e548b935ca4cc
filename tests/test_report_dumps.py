"""The debug dumps under ``config.debug_dir`` (issue 16): no write follows a symbolic link, folders are private
(0700) and new per run, ``~`` is expanded, a graph served from Inductor's caches still gets a report (saying so),
and ``TORCH_LOGS="+fusenorm"`` at debug level gives the reason for every candidate not rewritten."""

import itertools
import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import fusenorm_inductor
from fusenorm_inductor import config, report

from . import CACHES_OFF

ROOT = Path(__file__).resolve().parent.parent


def _compile_step(seed: int = 0) -> None:
    """Linear -> LayerNorm, compiled with backend="fusenorm", forward and backward (one fresh compile)."""
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    torch.compile(model, backend="fusenorm")(torch.randn(4, 8)).sum().backward()


def _runs(debug_dir: Path) -> list[Path]:
    return sorted(p for p in debug_dir.iterdir() if p.name.startswith("run-"))


def _tree(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_symlink_at_the_old_graph_path_is_not_followed(tmp_path, monkeypatch):
    """A link planted where the report used to go (``<debug_dir>/000_0_0``, a predictable name) stays untouched,
    and so does what it points to: the reports go into a new run folder."""
    monkeypatch.setattr(report, "_seq", itertools.count())  # graph ids from 000, as in a fresh process
    debug_dir, victim = tmp_path / "fn", tmp_path / "victim"
    debug_dir.mkdir()
    victim.mkdir()
    (victim / "report.md").write_text("keep me")
    (debug_dir / "000_0_0").symlink_to(victim, target_is_directory=True)
    with config.patch(debug_dir=str(debug_dir)):
        _compile_step()
    assert (debug_dir / "000_0_0").is_symlink() and os.readlink(debug_dir / "000_0_0") == str(victim)
    assert _tree(victim) == {"report.md": b"keep me"}
    (run,) = _runs(debug_dir)
    rep = json.loads((run / "000_0_0" / "report.json").read_text())
    assert [r["pattern"] for r in rep["rewrites"]] == ["canonical_layer_norm", "linear_norm_fwd"]


def test_folders_private_and_new_per_run(tmp_path):
    """Every folder created is mode 0700 (files 0600); a new run (here: after clear(), as in a new process) gets a
    new run folder, and the earlier run's files stay as they were; each run has an index of its graphs."""
    debug_dir = tmp_path / "a" / "b"
    with config.patch(debug_dir=str(debug_dir)):
        _compile_step()
        (first,) = _runs(debug_dir)
        before = _tree(first)
        fusenorm_inductor.report.clear()
        _compile_step(seed=1)
    runs = _runs(debug_dir)
    assert len(runs) == 2 and first in runs
    assert _tree(first) == before
    for run in runs:
        (graph_dir,) = [p for p in run.iterdir() if p.is_dir()]
        for d in (tmp_path / "a", debug_dir, run, graph_dir):
            assert _mode(d) == 0o700, (d, oct(_mode(d)))
        files = [p for p in run.rglob("*") if p.is_file()]
        assert {"report.md", "report.json", "index.md", "index.json", "forward.after.py"} <= {p.name for p in files}
        assert all(_mode(p) == 0o600 for p in files)
        assert not [p for p in files if p.name.endswith(".tmp")]
        index = json.loads((run / "index.json").read_text())
        assert [(g["dir"], g["rewrites"], g["cache_hit"]) for g in index["graphs"]] == [(graph_dir.name, 2, {})]
        assert f"]({graph_dir.name}/report.md)" in (run / "index.md").read_text()


def test_debug_dir_that_is_a_symlink_is_refused_with_a_warning(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "fn").symlink_to(victim, target_is_directory=True)
    with config.patch(debug_dir=str(tmp_path / "fn"), fallback_on_error=True), warnings.catch_warnings(
            record=True) as caught:
        warnings.simplefilter("always")
        _compile_step()
    ours = [str(w.message) for w in caught if "fusenorm" in str(w.message)]
    # One warning per graph, with the reason (the link, named), not one per stage that tried to write.
    assert len(ours) == 1, ours
    assert f"{tmp_path / 'fn'} is a symbolic link" in ours[0] and "debug dumps of graph" in ours[0], ours
    assert list(victim.iterdir()) == []
    assert fusenorm_inductor.last_report().rewrites  # the compile itself went on, fused


def test_debug_dir_under_a_symlinked_parent_is_refused(tmp_path):
    """A link anywhere on the path counts: debug_dir = <link>/sub must not land in the link's target."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "l").symlink_to(victim, target_is_directory=True)
    with config.patch(debug_dir=str(tmp_path / "l" / "sub"), fallback_on_error=True), pytest.warns(
            UserWarning, match=f"{tmp_path / 'l'} is a symbolic link and lies on the debug_dir path"):
        _compile_step()
    assert list(victim.iterdir()) == []
    assert fusenorm_inductor.last_report().rewrites


def test_run_folder_replaced_by_a_symlink_is_not_written_through(tmp_path):
    """The run folder swapped for a link between two writes: the second write refuses (a warning), and
    neither the link's target nor the moved folder is written."""
    debug_dir, victim = tmp_path / "fn", tmp_path / "victim"
    victim.mkdir()
    with config.patch(debug_dir=str(debug_dir), fallback_on_error=True):
        _compile_step()
        (run,) = _runs(debug_dir)
        moved = run.rename(tmp_path / "moved")
        before = _tree(moved)
        run.symlink_to(victim, target_is_directory=True)
        with pytest.warns(UserWarning, match="debug dumps of graph .* not written .*symbolic link"):
            _compile_step(seed=1)
    assert list(victim.iterdir()) == [] and _tree(moved) == before


def test_put_does_not_write_through_a_symlinked_file(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "report.md").symlink_to(victim)
    fd = os.open(tmp_path / "d", os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="symbolic link"):
            report._put(fd, "report.md", "overwritten")
    finally:
        os.close(fd)
    assert victim.read_text() == "keep me" and (tmp_path / "d" / "report.md").is_symlink()


def test_tilde_in_debug_dir_is_expanded(tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    with config.patch(debug_dir="~/fn-debug"):
        _compile_step()
    assert not (cwd / "~").exists()
    (run,) = _runs(home / "fn-debug")
    assert list(run.glob("*/report.json"))


def test_debug_log_gives_the_reason_for_each_skipped_candidate(caplog):
    caplog.set_level(logging.DEBUG, logger="fusenorm")
    _compile_step()
    skips = [s for r in fusenorm_inductor.reports() for s in r.skips]
    assert skips  # the output gradient is a tangent: dgrad_norm_bwd is seen and left alone
    records = [r for r in caplog.records if r.name == "fusenorm"]
    summaries = [r for r in records if r.levelno == logging.INFO and "candidate(s) not rewritten" in r.getMessage()]
    skipped = [r for r in records if r.levelno == logging.DEBUG and " not rewritten at " in r.getMessage()]
    assert summaries and len(skipped) == len(skips)
    for s, r in zip(skips, skipped):
        msg = r.getMessage()
        assert "\n" not in msg and s.pattern in msg and s.stage in msg and s.reason in msg, msg


_CACHE_RUN = textwrap.dedent(
    """
    import torch
    import fusenorm_inductor
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16))
    torch.compile(model, backend="fusenorm")(torch.randn(4, 8)).sum().backward()
    """
)


def test_cache_hit_in_a_second_process_writes_a_report_saying_so(tmp_path):
    """A second process with the same Inductor cache dir is served from the cache (fusenorm's passes do not run):
    it still writes a run folder, with a report saying the graph came from the cache; the first run's stays."""
    debug_dir = tmp_path / "fn"
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TORCH_LOGS", *CACHES_OFF)}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), FUSENORM_CACHE_DIR=str(tmp_path / "fusenorm"),
               FUSENORM_DEBUG_DIR=str(debug_dir), FUSENORM_TUNE="0", TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="0")
    trees = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", _CACHE_RUN], capture_output=True, text=True, env=env, cwd=ROOT,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-4000:]
        trees.append({run: _tree(run) for run in _runs(debug_dir)})
    first, second = trees
    (first_run,) = first
    assert len(second) == 2 and second[first_run] == first[first_run]  # a new folder; the first one untouched
    (second_run,) = set(second) - {first_run}
    (graph,) = json.loads((first_run / "index.json").read_text())["graphs"]
    assert graph["rewrites"] and not graph["cache_hit"]
    (graph,) = json.loads((second_run / "index.json").read_text())["graphs"]
    assert graph["cache_hit"]["aot_autograd"] >= 1, graph
    rep = json.loads((second_run / graph["dir"] / "report.json").read_text())
    assert rep["cache_hit"] == graph["cache_hit"] and not [r for r in rep["rewrites"] if r["stage"] == "joint"]
    assert "TORCHINDUCTOR_FORCE_DISABLE_CACHES=1" in (second_run / graph["dir"] / "report.md").read_text()
    assert "served from Inductor's cache" in (second_run / "index.md").read_text()


def test_last_report_answers_for_a_graph_served_from_the_cache(tmp_path):
    """Without a debug_dir, a process served from Inductor's cache still gets a report from last_report(),
    saying the graph came from the cache (it used to return None there)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TORCH_LOGS", "FUSENORM_DEBUG_DIR", *CACHES_OFF)}
    env.update(TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), FUSENORM_CACHE_DIR=str(tmp_path / "fusenorm"),
               FUSENORM_TUNE="0", TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="0")
    script = _CACHE_RUN + textwrap.dedent(
        """
        rep = fusenorm_inductor.last_report()
        print("REPORT", None if rep is None else sorted(rep.cache_hit))
        """
    )
    printed = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                             timeout=600)
        assert out.returncode == 0, out.stderr[-4000:]
        printed.append(next(line for line in out.stdout.splitlines() if line.startswith("REPORT")))
    assert printed == ["REPORT []", "REPORT ['aot_autograd', 'fx_graph']"], printed
