"""The package's imports run down the flow of docs/architecture.md and form no cycle.

The rule is docs/architecture.md's unit table: each row names its units and the units they may
import; units whose third-party column says "no torch" must never import torch. Every
``import`` / ``from ... import`` statement of every module (module level, inside functions, and
under ``TYPE_CHECKING`` alike) is read from the source with ``ast``; an import of a peakprobe
module is an edge. A module whose unit the table does not list fails, and the module graph must
be acyclic.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "peakprobe"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _unit_name(text: str) -> str:
    return text.strip().strip("`").removesuffix(".py").rstrip("/")


def read_table(text: str) -> tuple[dict[str, set[str]], set[str], set[str]]:
    """(unit -> the units it may import, the units that may import all, the torch-free units)
    from the architecture document's unit table."""
    allowed: dict[str, set[str]] = {}
    top: set[str] = set()
    torch_free: set[str] = set()
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        units = [_unit_name(u) for u in re.findall(r"`[^`]+`", cells[0])]
        may = cells[2]
        names = set() if may in ("—", "-", "") else {_unit_name(u) for u in may.split(",")}
        for unit in units:
            if may == "all":
                top.add(unit)
            else:
                allowed[unit] = names
            if "no torch" in cells[3]:
                torch_free.add(unit)
    return allowed, top, torch_free


ALLOWED, TOP, TORCH_FREE = read_table(ARCHITECTURE.read_text(encoding="utf-8"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _unit(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _imports(module: str, path: Path) -> list[str]:
    """Every peakprobe module (or package) that ``module`` imports, and every other top-level
    package it imports (e.g. ``torch``)."""
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # `from pkg import submodule` imports the submodule
                sub = f"{target}.{alias.name}"
                out.append(sub if sub in MODULES else target)
    return out


GRAPH = {m: [t for t in _imports(m, p) if t in MODULES and t != m] for m, p in MODULES.items()}


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_flow(module):
    unit = _unit(module)
    if unit in TOP:
        return
    assert unit in ALLOWED, f"{module}: unit {unit!r} is not in docs/architecture.md's table"
    bad = sorted({t for t in GRAPH[module] if _unit(t) not in ALLOWED[unit] | {unit}})
    assert not bad, f"{module} imports {bad}, against the flow (allowed: {sorted(ALLOWED[unit])})"
    if unit in TORCH_FREE:
        heavy = [t for t in _imports(module, MODULES[module]) if t.split(".")[0] == "torch"]
        assert not heavy, f"{module} must stay torch-free, imports {heavy}"


def test_there_is_no_import_cycle():
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in GRAPH[m]:
            if state.get(t) == 1:
                cycle = stack[stack.index(t):] + [t]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)


def test_the_walker_sees_a_planted_upward_import(tmp_path):
    """The check can fail: an upward import planted in a copy of a module is found."""
    fake = tmp_path / "peakprobe" / "probes" / "planted.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("from ..hooks import attach\nfrom . import rows\n")
    found = _imports("peakprobe.probes.planted", fake)
    assert "peakprobe.hooks" in found and "peakprobe.probes.rows" in found
    assert _unit("peakprobe.hooks") not in ALLOWED["probes"]


def test_the_table_is_read_and_covers_every_unit():
    """The parser sees the table (not an empty rule set) and every unit of the package is in it."""
    assert {"vocab", "probes", "hooks", "attribution", "checkpoint", "sweep", "fits"} <= set(ALLOWED)
    assert ALLOWED["probes"] == {"vocab"} and "torch" not in ALLOWED["fits"]
    assert {"fits", "reports", "vocab"} <= TORCH_FREE and "probes" not in TORCH_FREE
    assert {"cli", "api"} <= TOP
    units = {_unit(m) for m in MODULES}
    assert units <= set(ALLOWED) | TOP, sorted(units - set(ALLOWED) - TOP)


def test_an_edit_of_the_table_changes_the_rule():
    """Reading a table where probes may import hooks allows what the real one forbids."""
    edited = ARCHITECTURE.read_text(encoding="utf-8").replace(
        "| vocab | torch, triton (optional) |", "| vocab, hooks | torch, triton (optional) |")
    allowed, _, _ = read_table(edited)
    assert allowed["probes"] == {"vocab", "hooks"} != ALLOWED["probes"]


def _metric_literals(path: Path) -> list[tuple[int, str]]:
    """String literals of a module that spell a vocab metric name: every multi-word name, and
    a single-word one where it is compared (``metric == "loss"``); ``__all__`` lists of
    function names (``beta_eff``) do not count."""
    from peakprobe import vocab

    names = (set(vocab.ATTN_PROBE_METRICS) | set(vocab.LM_PROBE_METRICS) | set(vocab.SITE_METRICS)
             | set(vocab.ATTRIBUTION_ROW_METRICS) | {vocab.SINK_PROB} | set(vocab.ROUTER_PROBE_METRICS)
             | set(vocab.LOAD_METRICS) | set(vocab.ROLE_METRICS) | set(vocab.GEOMETRY_METRICS)
             | set(vocab.LM_FACTOR_METRICS))
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    exported = {id(c) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                and any(getattr(t, "id", "") == "__all__" for t in node.targets)
                for c in ast.walk(node.value)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            if id(node) in exported or isinstance(parents.get(node), ast.JoinedStr):
                continue
            if "_" in node.value or isinstance(parents.get(node), ast.Compare):
                found.append((node.lineno, node.value))
    return found


def test_metric_names_are_spelled_once_in_vocab():
    bare = {name: _metric_literals(path) for name, path in MODULES.items() if name != "peakprobe.vocab"}
    bare = {k: v for k, v in bare.items() if v}
    assert not bare, f"metric names spelled outside vocab (use vocab's constants): {bare}"


def test_the_metric_name_check_sees_a_planted_literal(tmp_path):
    fake = tmp_path / "planted.py"
    fake.write_text('def f(frame):\n    return frame[frame.metric == "loss"], "logit_std"\n')
    assert sorted(v for _, v in _metric_literals(fake)) == ["logit_std", "loss"]
