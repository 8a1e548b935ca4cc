"""The package's layers, read from its source with ast (no import is executed).

- kernels/ (every GPU kernel and its launcher) imports nothing from ops/, tuning/, patterns/ or backends/;
- backends/ (the kernel libraries behind one interface) imports nothing from ops/, tuning/ or patterns/;
- kernels/hopper (the Gluon kernels) imports nothing from kernels/triton (the ``tl`` kernels);
- ops/ (the custom ops) and tuning/ (timing, cache, decisions) import nothing from patterns/, and tuning/ nothing
  from ops/ (it reaches the ops through ``torch.ops``; the norms' math is norm_math.py);
- config.py imports nothing of fusenorm's (it holds data; the passes register their hook with it);
- no import cycle between modules, counting imports inside functions too (a lazy import only delays a cycle);
- ``@triton.jit`` / ``@gluon.jit`` code lives in kernels/ only, and custom ops are defined in ops/ only.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

PACKAGE = "fusenorm_inductor"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def _modules() -> dict[str, Path]:
    """Module name -> file, for every .py file of the package (patterns/ is a symbolic link: followed)."""
    out = {}
    for d, _, names in os.walk(ROOT, followlinks=True):
        for f in names:
            if not f.endswith(".py"):
                continue
            rel = Path(d, f).relative_to(ROOT).with_suffix("")
            parts = [PACKAGE, *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = Path(d, f)
    return out


MODULES = _modules()


def _base(module: str, path: Path, level: int, name: str | None) -> str:
    """The absolute module a (possibly relative) ``from ... import`` names."""
    if level == 0:
        return name or ""
    parts = module.split(".")
    if path.name != "__init__.py":
        parts = parts[:-1]
    parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([name] if name else []))


def _imports(module: str, path: Path) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its file: ``from a import b`` counts as
    a.b where that is a module (a submodule), else as a."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, path, node.level, node.module)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found.update(n for n in names if n == PACKAGE or n.startswith(PACKAGE + "."))
    found.discard(module)
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


FORBIDDEN = {
    "kernels": ("ops", "tuning", "patterns", "backends"),
    "backends": ("ops", "tuning", "patterns"),
    "ops": ("patterns",),
    "tuning": ("patterns", "ops"),
}


def test_the_walk_sees_every_layer():
    """The checks below mean something only if the walk finds the modules (the link included)."""
    layers = {_layer(m) for m in MODULES}
    assert {"kernels", "ops", "tuning", "patterns", "config"} <= layers, sorted(filter(None, layers))
    assert f"{PACKAGE}.kernels.triton.mm_norm" in GRAPH and f"{PACKAGE}.patterns.post_norm" in GRAPH


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_import_only_below(layer):
    bad = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() if _layer(m) == layer
                 for d in deps if _layer(d) in FORBIDDEN[layer])
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_gluon_kernels_do_not_import_the_tl_kernels():
    """kernels/hopper takes what both families share from kernels/gemm_config.py, not from kernels/triton."""
    hopper = f"{PACKAGE}.kernels.hopper"
    bad = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() if m.startswith(hopper)
                 for d in deps if d.startswith(f"{PACKAGE}.kernels.triton"))
    assert not bad, "\n".join(bad)


def test_config_holds_data_only():
    assert not GRAPH[f"{PACKAGE}.config"], GRAPH[f"{PACKAGE}.config"]


def _cycle() -> list[str] | None:
    """One import cycle among the package's modules, or None (depth-first search, colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(GRAPH.get(m, ())):
            if d not in GRAPH:
                continue
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)) is not None:
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(GRAPH):
        if m not in state and (found := visit(m)) is not None:
            return found
    return None


def test_no_import_cycle():
    cycle = _cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_can_fail():
    """The search finds a planted cycle (so a pass above is not a search that never looks)."""
    a, b = f"{PACKAGE}.kernels.triton.common", f"{PACKAGE}.config"
    saved = set(GRAPH[b])
    GRAPH[b].add(a)
    GRAPH[a] = GRAPH[a] | {b}
    try:
        assert _cycle() is not None
    finally:
        GRAPH[b] = saved
        GRAPH[a].discard(b)


def _decorated(path: Path, names: tuple[str, ...]) -> bool:
    """Whether the file has a function decorated with one of ``names`` (``triton.jit``, ``gluon.jit``, ...)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if ast.unparse(target) in names:
                    return True
    return False


def test_kernels_live_in_kernels_and_ops_in_ops():
    jit = ("triton.jit", "gluon.jit", "jit")
    ops = ("torch.library.custom_op", "custom_op")
    misplaced = [f"{m}: GPU kernel outside kernels/" for m, p in MODULES.items()
                 if _layer(m) != "kernels" and _decorated(p, jit)]
    misplaced += [f"{m}: custom op outside ops/" for m, p in MODULES.items()
                  if _layer(m) != "ops" and _decorated(p, ops)]
    assert not misplaced, "\n".join(misplaced)


def _top_level_names(path: Path) -> set[str]:
    """The names a module binds at its top level (also inside top-level ``if``/``try`` blocks)."""
    names: set[str] = set()

    def bind(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, ast.If):
                bind(node.body)
                bind(node.orelse)
            elif isinstance(node, ast.Try):
                bind(node.body)
                for h in node.handlers:
                    bind(h.body)
                bind(node.orelse)
                bind(node.finalbody)

    bind(ast.parse(path.read_text()).body)
    return names


def _unresolved(module: str, path: Path) -> list[str]:
    """The package-internal imports of ``module`` (function bodies included) that name no module of the package
    and no top-level name of the module they import from: an import that fails only when its line runs (a lazy
    import in a GPU-only branch is never run by the CPU suite)."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = _base(module, path, node.level, node.module)
            if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
                continue
            if base not in MODULES:
                bad.append(f"{module}:{node.lineno}: no module {base}")
                continue
            defined = _top_level_names(MODULES[base])
            bad += [f"{module}:{node.lineno}: {base} has no {a.name}" for a in node.names
                    if a.name != "*" and a.name not in defined and f"{base}.{a.name}" not in MODULES]
        elif isinstance(node, ast.Import):
            bad += [f"{module}:{node.lineno}: no module {a.name}" for a in node.names
                    if a.name.startswith(PACKAGE + ".") and a.name not in MODULES]
    return bad


def test_every_import_of_the_package_resolves():
    bad = [line for m, p in MODULES.items() for line in _unresolved(m, p)]
    assert not bad, "imports that fail when they run:\n" + "\n".join(bad)


def test_the_resolution_check_can_fail(tmp_path):
    """A planted lazy import of a name the package lacks is reported (the check is not one that never looks)."""
    f = tmp_path / "probe.py"
    f.write_text("def f():\n    from .. import config\n    from .common import no_such_name\n")
    bad = _unresolved(f"{PACKAGE}.kernels.triton.probe", f)
    assert len(bad) == 2 and "kernels has no config" in bad[0] and "no_such_name" in bad[1], bad
