"""What a user meets first: every public name has a docstring, ``help(config)`` lists every option with its
default, environment variable and description, a misspelled option is answered with the closest name, and
``debug_dir = ""`` is refused; the match report names each site by the model's module path and source line,
once."""

from __future__ import annotations

import pydoc

import pytest
import torch

import fusenorm_inductor as fi
from fusenorm_inductor import config, ops


@pytest.mark.parametrize("name", fi.__all__ + [f"ops.{n}" for n in ops.__all__])
def test_public_names_have_docstrings(name):
    if name == "__version__":
        return
    obj = getattr(ops, name[4:]) if name.startswith("ops.") else getattr(fi, name)
    doc = getattr(obj, "__doc__", None) or ""
    assert doc.strip() and "CustomOpDef" not in doc, f"{name} has no docstring of its own"


def test_help_lists_every_option():
    text = pydoc.render_doc(config, renderer=pydoc.plaintext)
    for name, entry in config._config.items():
        assert f"{name} = {entry.default!r}" in text, name
    assert "(no description)" not in text
    assert "environment: FUSENORM_CPU_REFERENCE" in text


@pytest.mark.parametrize("how", ["set", "get", "patch", "nested"])
def test_a_misspelled_option_names_the_closest(how):
    with pytest.raises(AttributeError, match="did you mean 'debug_dir'|did you mean 'tuning.measure'"):
        if how == "set":
            config.debug_dri = "/tmp/x"
        elif how == "get":
            config.debug_dri  # noqa: B018
        elif how == "patch":
            with config.patch(debug_dri="/tmp/x"):
                pass
        else:
            config.tuning.meausre = False
    with pytest.raises(AttributeError, match="lists the options"):
        config.zzzzzz = 1


def test_empty_debug_dir_is_refused():
    with pytest.raises(ValueError, match="non-empty directory path"):
        config.debug_dir = ""
    with pytest.raises(ValueError, match="non-empty"):
        with config.patch(debug_dir=""):
            pass
    assert config.debug_dir is None or config.debug_dir != ""


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(24, 40)
        self.norm = torch.nn.LayerNorm(40)
        self.wide = torch.nn.LayerNorm([9, 40])  # over two dims: no fusion takes it

    def forward(self, x):
        return self.wide(self.norm(self.proj(x)))


def test_report_names_sites_by_module_path_once():
    torch.manual_seed(0)
    with config.patch(cpu_reference=True):
        torch.compile(_Block(), backend="fusenorm")(torch.randn(3, 9, 24))
    rep = fi.reports()[0]
    fused = [r for r in rep.rewrites if r.pattern == "linear_norm_fwd"]
    assert fused and "proj" in fused[0].where and "norm" in fused[0].where and "test_public_surface.py:" in \
        fused[0].where, fused[0].where
    text = rep.to_markdown()
    seen = text.split("## Seen, not rewritten", 1)[1].split("\n## ", 1)[0]
    listed = [line for line in seen.splitlines() if line.startswith("- `")]
    assert listed and "module wide" in seen, seen  # the two-dim norm, by its module's name
    nodes = [line.split("`")[1] for line in listed]
    assert len(nodes) == len(set(nodes)), seen  # each site once, every fusion's reason on its line
    taken = {n for r in rep.rewrites for n in r.nodes}
    assert not taken & set(nodes), seen  # a rewritten site is not also listed as not rewritten


def test_a_restarted_dynamic_compile_leaves_one_report():
    """A dynamic-shape compile that Dynamo restarts (it specializes the norm's float eps) ran the pre-grad pass on
    a graph that never runs: only the compile that finished has a report."""
    m = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.LayerNorm(40), torch.nn.Linear(40, 8))
    with config.patch(cpu_reference=True):
        cm = torch.compile(m, backend="fusenorm", dynamic=True)
        cm(torch.randn(5, 24))
        cm(torch.randn(7, 24))
    reps = fi.reports()
    assert len(reps) == 1 and any(r.pattern == "linear_norm_fwd" for r in reps[0].rewrites), \
        [r.to_markdown() for r in reps]
    assert not any("not a constant" in s.reason for s in reps[0].skips)
