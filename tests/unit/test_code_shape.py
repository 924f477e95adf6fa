"""The shape the code keeps (docs/architecture.md, "Where things live"): small files, no import circle
between files (imports under TYPE_CHECKING and inside functions included), device questions asked of
the backends only, runtime classes of at most 20 methods, and no script or harness that reaches into a
runner to flip its attributes. Each rule is checked over the package as it is, and each checker is
shown to catch a planted breach."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "flashx_batch"
JOBS = PACKAGE.parent / "jobs"
MAX_LINES = 450
MAX_METHODS = 20
# the public API may be as wide as users need; the runtime's inner classes may not
WIDE_CLASSES = {"Engine"}
# a device-type question in code: `x.type == "cuda"`, `.device.type != "cpu"`, `get_backend("cuda")` ...
DEVICE_BRANCH = re.compile(r"""\.type\s*(==|!=|in)\s*[("']|\.device_type\s*(==|!=)\s*["']|get_backend\(\s*["']""")
RUNNER_ATTRIBUTE_SET = re.compile(r"\brunner\.(?!passes\b)[a-z_]\w*\s*=[^=]")


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports anywhere in its text (a package's own __init__
    imported by its children is not an edge: Python runs it first whatever they import)."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".") if is_package else name.split(".")[:-1]
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join([*parts, base] if base else parts)
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def wide_classes(root: Path) -> list[str]:
    out = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name not in WIDE_CLASSES:
                methods = sum(isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef) for b in node.body)
                if methods > MAX_METHODS:
                    out.append(f"{path.relative_to(root.parent)}:{node.name} ({methods} methods)")
    return out


def device_branches(root: Path) -> list[str]:
    out = []
    for path in root.rglob("*.py"):
        if "backends" in path.relative_to(root).parts:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if DEVICE_BRANCH.search(code):
                out.append(f"{path.relative_to(root.parent)}:{number}: {line.strip()}")
    return out


def runner_attribute_sets(*roots: Path) -> list[str]:
    out = []
    for root in roots:
        for path in root.rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if RUNNER_ATTRIBUTE_SET.search(line.split("#", 1)[0]):
                    out.append(f"{path.name}:{number}: {line.strip()}")
    return out


def test_no_package_file_is_over_450_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by what they own: {long}"


def test_no_import_circle_between_files():
    assert cycles(import_graph(PACKAGE)) == []


def test_the_cycle_finder_finds_a_planted_circle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.a import A\n")  # a parent importing its child: fine
    (pkg / "sub" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub import a\n")
    assert cycles(import_graph(pkg)) == [["pkg.b", "pkg.sub", "pkg.sub.a"]]  # b runs sub's __init__ too


def test_device_questions_are_asked_of_the_backends_only():
    assert device_branches(PACKAGE) == []


def test_the_device_branch_pattern_catches_the_usual_spellings():
    for line in ('if x.device.type == "cuda":', "if t.device.type != 'cpu':", 'b = get_backend("cuda")',
                 'kind in ("cpu",) if d.type in ("cpu", "cuda") else 0'):
        assert DEVICE_BRANCH.search(line), line
    for line in ('backend = get_backend(options.backend)', 'torch.device("cpu")', 'x.dtype == torch.float32'):
        assert not DEVICE_BRANCH.search(line), line


def test_runtime_classes_stay_small():
    assert wide_classes(PACKAGE / "runtime") == []


def test_no_harness_flips_runner_attributes():
    assert runner_attribute_sets(PACKAGE, JOBS) == []
    assert RUNNER_ATTRIBUTE_SET.search("engine.runner.merge = settings")
    for line in ("self.runner = runner", "a.runner.x == 1"):
        assert not RUNNER_ATTRIBUTE_SET.search(line), line
