"""The architecture, checked: rooms by layer, dependencies one way, no cycles, short functions.

Every module under ``autoplan/`` (``autoplan/passes`` and ``autoplan/cost_models`` are symbolic
links to the top-level ``passes/`` and ``cost_models/`` folders, and count as
``autoplan.passes.*`` / ``autoplan.cost_models.*``) is parsed with :mod:`ast`; nothing is
imported. An *import* is an ``import`` or ``from ... import`` statement anywhere in the module:
at module level, inside a function (a *function-level import*), under ``if TYPE_CHECKING:``
(a type-only dependency is still a dependency), plus ``importlib.import_module("autoplan...")``
with a constant name and a module-level table whose values all name internal modules (the lazy
export table ``autoplan/__init__.py`` reads with ``importlib``). ``from P import x`` is an import of
``P.x`` when that is a module, else of ``P``. Importing a module also runs its parent packages'
``__init__``; that implicit step is not an edge (package ``__init__`` files stay light).

The layers, lowest first (an import may point to its own layer or a lower one):

1. vocabulary and errors: ``cost_models/{errors,echo,files,config}.py``
2. cost models: the rest of ``cost_models/``
3. graph passes: ``passes/``
4. planner: ``autoplan/planner/``
5. runtime: ``autoplan/runtime/``
6. public API: ``autoplan/{__init__,api,errors,workload,testing,__main__}.py``
7. tools: ``autoplan/tools/``

Checks: (a) no import cycle among the modules, function-level imports included (a failure
names the cycle as a path ``a -> b -> a``); (b) every import points down the layer order, except
the pairs in :data:`UPWARD_EXCEPTIONS`, each with its reason; a module in no layer fails too;
(c) nothing in the repository (``*.py`` anywhere, code in ``*.md``) imports the top-level names
``passes`` or ``cost_models``: only ``autoplan.passes`` / ``autoplan.cost_models`` are installed;
(d) function-level imports of internal modules only for the pairs in
:data:`FUNCTION_LEVEL_IMPORTS`, each with its reason (an allow-list entry no import uses fails
too, so the list cannot go stale); (e) no function longer than :data:`MAX_FUNCTION_LINES` lines
(``def`` line to last line, nested functions measured on their own) unless its docstring gives
the reason in the form ``(long: REASON)``, e.g. ``(long: one table of 40 cases read top to
bottom; split, it would hide the order)``; REASON has at least :data:`MIN_REASON_CHARS` characters.
"""

from __future__ import annotations

import ast
import functools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autoplan"

MAX_FUNCTION_LINES = 100
MIN_REASON_CHARS = 10
LONG_REASON = re.compile(r"\(long: ([^)]*)\)")

VOCABULARY = frozenset(f"autoplan.cost_models.{name}" for name in ("errors", "echo", "files", "config"))
PUBLIC_API = frozenset(
    ["autoplan"] + [f"autoplan.{name}" for name in ("api", "errors", "workload", "testing", "__main__")]
)
LAYER_NAMES = ("vocabulary and errors", "cost models", "graph passes", "planner", "runtime", "public API", "tools")

UPWARD_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("autoplan.__main__", "autoplan.tools.cli"): (
        "`python -m autoplan` is the command line's second entry point (like the `autoplan` script); "
        "the module holds nothing but that call"
    ),
}
"""(importer, imported) pairs allowed to point up the layer order, with the reason."""

_LAZY = "lazy export table (PEP 562) of autoplan/__init__.py"
_TORCH_FREE = "torch-free: "
FUNCTION_LEVEL_IMPORTS: dict[tuple[str, str], str] = {
    # The package: `import autoplan`, `autoplan --help` and the review commands load no torch.
    ("autoplan", "autoplan.api"): f"{_TORCH_FREE}{_LAZY}",
    ("autoplan", "autoplan.cost_models.step"): f"{_TORCH_FREE}{_LAZY}",
    ("autoplan", "autoplan.runtime.parallel"): f"{_TORCH_FREE}{_LAZY}",
    ("autoplan", "autoplan.runtime.pipeline"): f"{_TORCH_FREE}{_LAZY}",
    ("autoplan", "autoplan.workload"): f"{_TORCH_FREE}{_LAZY}",
    ("autoplan", "autoplan.cost_models.cluster"): f"{_LAZY}: every public name resolves through the one table",
    ("autoplan", "autoplan.cost_models.config"): f"{_LAZY}: every public name resolves through the one table",
    ("autoplan", "autoplan.cost_models.hardware"): f"{_LAZY}: every public name resolves through the one table",
    ("autoplan", "autoplan.errors"): f"{_LAZY}: every public name resolves through the one table",
    ("autoplan", "autoplan.planner.plan"): f"{_LAZY}: every public name resolves through the one table",
    # The plan value and `autoplan explain` are read by the review commands, which load no torch.
    ("autoplan.planner.plan", "autoplan.passes.placement"): f"{_TORCH_FREE}Plan.load/show/diff of the review commands",
    ("autoplan.planner.plan", "autoplan.passes.strategies"): f"{_TORCH_FREE}Plan.load/show/diff of the review commands",
    ("autoplan.passes.explain", "autoplan.passes.costing"): f"{_TORCH_FREE}`autoplan explain` on a plan file",
    ("autoplan.passes.explain", "autoplan.passes.placement"): f"{_TORCH_FREE}`autoplan explain` on a plan file",
    # The command modules are imported by the CLI at start-up (`autoplan --help` loads no torch).
    ("autoplan.tools.cli", "autoplan.tools.export_onnx"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.common", "autoplan.api"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.common", "autoplan.tools.loader"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.calibrate", "autoplan.cost_models.calibration"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.calibrate", "autoplan.runtime.collective_bench"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.calibrate", "autoplan.cost_models.trace_calibration"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.local_links", "autoplan.cost_models.calibration"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.local_links", "autoplan.runtime.collective_bench"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.planning", "autoplan.planner.joint"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.planning", "autoplan.tools.loader"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.profile", "autoplan.cost_models.profile_db"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.profile", "autoplan.passes.costing"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.profile", "autoplan.passes.strategies"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.profile", "autoplan.passes.trace"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.profile", "autoplan.planner.mesh"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.profile", "autoplan.runtime.op_timing"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.profile", "autoplan.tools.loader"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.run", "autoplan.passes.trace"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.run", "autoplan.planner.ilp"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.run", "autoplan.planner.tracing"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.run", "autoplan.runtime.checkpoint"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.run", "autoplan.runtime.precision"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.run", "autoplan.tools.loader"): f"{_TORCH_FREE}CLI start-up",
    ("autoplan.tools.run", "autoplan.tools.training_data"): f"{_TORCH_FREE}CLI start-up",
}
"""(importer, imported) pairs allowed as function-level imports of internal modules, with the reason.
A reason starting with ``torch-free:`` is checked: the importer loads none of :data:`HEAVY_MODULES` at
module level (transitively) and the imported module does; a function-level import between two
light modules has no reason to be one."""

HEAVY_MODULES = frozenset({"torch", "numpy", "sympy", "transformers", "highspy", "scipy", "pulp", "onnx"})
"""Third-party modules whose import costs seconds (the set ``tests/test_cli_startup.py`` keeps out of the CLI)."""


@dataclass(frozen=True)
class Import:
    """One import of an internal module: ``source`` imports ``target`` at ``path:line``."""

    source: str
    target: str
    path: Path
    line: int
    function_level: bool
    type_only: bool = False  # under ``if TYPE_CHECKING:``

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


# --- reading the package ------------------------------------------------------------------------


def module_files() -> dict[str, Path]:
    """Every module under ``autoplan/`` (symbolic links followed), by dotted name."""
    modules: dict[str, Path] = {}
    for folder, dirs, files in os.walk(PACKAGE, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            parts = list(Path(folder, name).relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = Path(folder, name)
    return modules


MODULES = module_files()


def _absolute(source: str, path: Path, module: str | None, level: int) -> str:
    """The absolute name of ``from <level dots><module> import ...`` written in ``source``."""
    if level == 0:
        return module or ""
    package = source.split(".") if path.name == "__init__.py" else source.split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _internal(name: str) -> str | None:
    """The module ``name`` refers to: itself, or its longest prefix that is a module (``a.b.attr``)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _targets(source: str, path: Path, node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            target = _internal(alias.name)
            if target:
                yield target
    elif isinstance(node, ast.ImportFrom):
        base = _absolute(source, path, node.module, node.level)
        for alias in node.names:
            target = _internal(f"{base}.{alias.name}") if alias.name != "*" else None
            target = target or _internal(base)
            if target:
                yield target
    elif isinstance(node, ast.Call) and _is_import_module(node.func):
        arg = node.args[0] if node.args else None
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _internal(arg.value):
            yield _internal(arg.value) or ""


def _is_import_module(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id in ("import_module", "__import__")
    )


def _module_table(node: ast.stmt) -> list[str]:
    """Values of a module-level ``NAME = {...: "autoplan.x", ...}`` table whose values all name modules."""
    value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
    if not isinstance(value, ast.Dict) or not value.values:
        return []
    names = [v.value for v in value.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    if len(names) != len(value.values) or not all(name in MODULES for name in names):
        return []
    return names


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(source: str, path: Path) -> list[Import]:
    """The internal imports of one module, each marked module-level or function-level, and type-only."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
        for target in dict.fromkeys(_targets(source, path, node)):  # once per statement
            if target != source:
                found.append(Import(source, target, path, getattr(node, "lineno", 0), in_function, type_only))
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if _is_type_checking(node):
            assert isinstance(node, ast.If)
            for stmt in node.body:
                visit(stmt, inner, True)
            for stmt in node.orelse:
                visit(stmt, inner, type_only)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, inner, type_only)

    visit(tree, False, False)
    for stmt in tree.body:
        for target in _module_table(stmt):
            found.append(Import(source, target, path, stmt.lineno, True))  # read on first use
    return found


@functools.cache
def heavy_imports_at_module_level(path: Path) -> frozenset[str]:
    """The :data:`HEAVY_MODULES` a module imports itself when it is imported (not in functions, not type-only)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if _is_type_checking(node):
            assert isinstance(node, ast.If)
            for stmt in node.orelse:
                visit(stmt)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return frozenset(found & HEAVY_MODULES)


IMPORTS = [imp for source, path in MODULES.items() for imp in imports_of(source, path)]


def heavy_on_import() -> dict[str, frozenset[str]]:
    """For every module, the heavy modules importing it loads (its own and its module-level imports')."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in IMPORTS:
        if not imp.function_level and not imp.type_only:
            edges[imp.source].add(imp.target)
    result: dict[str, frozenset[str]] = {}
    for module in MODULES:
        seen, todo, heavy = {module}, [module], set[str]()
        while todo:
            current = todo.pop()
            heavy |= heavy_imports_at_module_level(MODULES[current])
            todo += [t for t in edges[current] if t not in seen]
            seen.update(edges[current])
        result[module] = frozenset(heavy)
    return result


def layer_of(module: str) -> int | None:
    """The layer index (0 = vocabulary ... 6 = tools) of a module, None when it belongs to no room."""
    if module in VOCABULARY:
        return 0
    rooms = [
        ("autoplan.cost_models", 1),
        ("autoplan.passes", 2),
        ("autoplan.planner", 3),
        ("autoplan.runtime", 4),
        ("autoplan.tools", 6),
        ("autoplan.integrations", 5),
    ]
    for prefix, layer in rooms:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return 5 if module in PUBLIC_API else None


# --- (a) cycles ---------------------------------------------------------------------------------


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as a path ``[a, b, ..., a]``, or None (iterative DFS)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in sorted(edges):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(edges.get(start, ())))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(edges.get(nxt, ()))))
    return None


def all_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Cycles found one at a time, breaking each found cycle's last edge before looking again."""
    edges = {k: set(v) for k, v in edges.items()}
    cycles = []
    while (cycle := find_cycle(edges)) is not None:
        cycles.append(cycle)
        edges[cycle[-2]].discard(cycle[-1])
    return cycles


def test_the_module_graph_has_no_import_cycle():
    edges: dict[str, set[str]] = {}
    for imp in IMPORTS:
        edges.setdefault(imp.source, set()).add(imp.target)
    cycles = all_cycles(edges)
    sites = {(imp.source, imp.target): imp.where() for imp in IMPORTS}
    report = [
        " -> ".join(cycle) + "\n    " + ", ".join(f"{a}->{b} at {sites[a, b]}" for a, b in zip(cycle, cycle[1:]))
        for cycle in cycles
    ]
    assert not cycles, f"{len(cycles)} import cycle(s):\n" + "\n".join(report)


def test_find_cycle_reports_the_cycle_as_a_path():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}}) is None


# --- (b) layers ---------------------------------------------------------------------------------


def test_every_module_belongs_to_a_layer():
    assert set(MODULES) >= {"autoplan", "autoplan.api", "autoplan.passes.trace", "autoplan.cost_models.cluster"}
    homeless = sorted(m for m in MODULES if layer_of(m) is None)
    assert not homeless, f"modules in no room (add them to a layer in tests/test_architecture.py): {homeless}"


def test_every_import_points_down_the_layer_order():
    upward = [
        f"{imp.where()}: {imp.source} ({LAYER_NAMES[layer_of(imp.source)]}) imports "
        f"{imp.target} ({LAYER_NAMES[layer_of(imp.target)]})"
        for imp in IMPORTS
        if layer_of(imp.source) is not None
        and layer_of(imp.target) is not None
        and layer_of(imp.target) > layer_of(imp.source)
        and (imp.source, imp.target) not in UPWARD_EXCEPTIONS
    ]
    assert not upward, f"{len(upward)} import(s) point up the layer order:\n" + "\n".join(upward)


def test_the_upward_exceptions_are_used_and_give_a_reason():
    used = {(imp.source, imp.target) for imp in IMPORTS}
    for pair, reason in UPWARD_EXCEPTIONS.items():
        assert pair in used, f"stale exception (no such import any more): {pair}"
        assert layer_of(pair[1]) > layer_of(pair[0]), f"{pair} points down: no exception needed"
        assert len(reason) >= MIN_REASON_CHARS, pair


# --- (c) one import name ------------------------------------------------------------------------

BANNED_TOP_LEVEL = ("passes", "cost_models")
SKIPPED_DIRS = {".git", "__pycache__", "build", "dist", "node_modules", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
MD_IMPORT = re.compile(r"^\s*(?:>>> |\.\.\. )?(?:from|import)\s+(passes|cost_models)\b")


def repository_files(suffix: str) -> Iterator[Path]:
    """Files of the checkout with this suffix (symbolic links not followed: each file is seen once)."""
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info"))
        for name in sorted(files):
            if name.endswith(suffix):
                yield Path(folder, name)


def banned_imports(code: str, label: str) -> list[str]:
    """``label:line: imports 'NAME'`` for every import of a banned top-level name in Python source."""
    found = []
    for node in ast.walk(ast.parse(code, filename=label)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            arg = node.args[0]
            names = [arg.value] if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else []
        for name in names:
            if name.split(".")[0] in BANNED_TOP_LEVEL:
                found.append(f"{label}:{getattr(node, 'lineno', 0)}: imports {name!r}")
    return found


def banned_imports_in_markdown(path: Path) -> list[str]:
    """``import``/``from`` lines of the code in a Markdown file (fenced blocks, indented blocks, doctest lines)."""
    return [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if MD_IMPORT.match(line)
    ]


def test_nothing_imports_the_top_level_names_passes_or_cost_models():
    python = list(repository_files(".py"))
    assert ROOT / "tests" / "test_architecture.py" in python and len(python) > 50
    found = [
        hit for path in python for hit in banned_imports(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    ]
    found += [hit for path in repository_files(".md") for hit in banned_imports_in_markdown(path)]
    assert not found, "import autoplan.passes / autoplan.cost_models instead:\n" + "\n".join(found)


def test_the_import_name_check_sees_every_spelling():
    code = "import passes.trace\nfrom cost_models import cluster\nimportlib.import_module('passes')\nimport autoplan.passes\n"
    assert banned_imports(code, "x.py") == [
        "x.py:1: imports 'passes.trace'",
        "x.py:2: imports 'cost_models'",
        "x.py:3: imports 'passes'",
    ]
    assert MD_IMPORT.match("    from passes.trace import trace") and MD_IMPORT.match(">>> import cost_models")
    assert not MD_IMPORT.match("from autoplan.passes import trace") and not MD_IMPORT.match("import passes_x")


# --- (d) function-level imports -----------------------------------------------------------------


def test_function_level_imports_of_internal_modules_are_on_the_allow_list():
    unlisted = sorted(
        f"{imp.where()}: {imp.source} imports {imp.target} inside a function"
        for imp in IMPORTS
        if imp.function_level and (imp.source, imp.target) not in FUNCTION_LEVEL_IMPORTS
    )
    assert not unlisted, (
        f"{len(unlisted)} function-level import(s) of internal modules not on FUNCTION_LEVEL_IMPORTS "
        "(move them to module level, or add the pair with its reason):\n" + "\n".join(unlisted)
    )


def test_the_function_level_allow_list_is_used_and_gives_reasons():
    used = {(imp.source, imp.target) for imp in IMPORTS if imp.function_level}
    stale = sorted(pair for pair in FUNCTION_LEVEL_IMPORTS if pair not in used)
    assert not stale, f"allow-list entries no function-level import uses (remove them): {stale}"
    assert all(len(reason) >= MIN_REASON_CHARS for reason in FUNCTION_LEVEL_IMPORTS.values())


def test_a_torch_free_reason_holds_the_importer_is_light_and_the_imported_module_heavy():
    heavy = heavy_on_import()
    assert heavy["autoplan.runtime.parallel"] >= {"torch"} and not heavy["autoplan.cost_models.errors"]
    wrong = [
        f"{source} -> {target}: importer loads {sorted(heavy[source]) or 'nothing heavy'}, "
        f"imported module loads {sorted(heavy[target]) or 'nothing heavy'}"
        for (source, target), reason in FUNCTION_LEVEL_IMPORTS.items()
        if reason.startswith(_TORCH_FREE)
        and source in MODULES
        and target in MODULES
        and (heavy[source] or not heavy[target])
    ]
    assert not wrong, "allow-list entries whose 'torch-free' reason does not hold:\n" + "\n".join(wrong)


# --- (e) function length ------------------------------------------------------------------------


def long_functions(path: Path) -> Iterator[tuple[str, int, int, str]]:
    """(qualified name, first line, length, docstring) of every function longer than the limit."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, int, int, str]]:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}."
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (child.end_lineno or child.lineno) - child.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    yield name[:-1], child.lineno, length, ast.get_docstring(child) or ""
            yield from visit(child, name)

    yield from visit(tree, "")


def has_long_reason(docstring: str) -> bool:
    match = LONG_REASON.search(" ".join(docstring.split()))
    return match is not None and len(match.group(1).strip()) >= MIN_REASON_CHARS


def test_no_function_is_longer_than_the_limit_without_a_reason():
    too_long = [
        f"{path.relative_to(ROOT)}:{line}: {name} has {length} lines"
        for path in MODULES.values()
        for name, line, length, doc in long_functions(path)
        if not has_long_reason(doc)
    ]
    assert not too_long, (
        f"{len(too_long)} function(s) over {MAX_FUNCTION_LINES} lines without '(long: REASON)' in the docstring "
        "(split them by phase, or state why not):\n" + "\n".join(too_long)
    )


def test_the_long_reason_convention():
    assert has_long_reason("Solve.\n\n(long: one table of 40 cases,\nread top to bottom)")
    assert not has_long_reason("Solve. (long: why)")
    assert not has_long_reason("A long function.")


@pytest.mark.parametrize(
    ("source", "is_init", "module", "level", "expected"),
    [
        ("autoplan.planner.joint", False, "search", 1, "autoplan.planner.search"),
        ("autoplan.planner.joint", False, None, 2, "autoplan"),
        ("autoplan.planner", True, "plan", 1, "autoplan.planner.plan"),
        ("autoplan.api", False, "autoplan.passes.trace", 0, "autoplan.passes.trace"),
    ],
)
def test_relative_imports_resolve_to_absolute_names(source, is_init, module, level, expected):
    path = Path("__init__.py") if is_init else Path("x.py")
    assert _absolute(source, path, module, level) == expected
