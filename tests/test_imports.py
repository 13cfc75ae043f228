"""Tier (a): no import cycle among the project's modules. Every module of scripts/, bench/ and
tests/ and the core files at the top level is parsed with `ast` (nothing is imported); each import
that names one of them, at any depth (a function's deferred import too), is an arrow, and a cycle
of arrows fails the test, naming its files. The arrows meant: the launcher -> the throughput model,
never the plots; every reader of a run directory (launcher, plots, trace, models, benches, tests)
-> scripts/rundir.py, which imports nothing of the project. Pure text: no torch, no vLLM.

Run: bash run.sh test tests/test_imports.py      (< 5 s)
"""
import ast
from pathlib import Path

from conftest import REPO

FOLDERS = ("scripts", "bench", "tests")  # the core files are the top level's *.py


def project_modules(root: Path) -> dict:
    """{dotted name: file} of the project: "common", "scripts.launch", "scripts" (its __init__)."""
    modules = {p.stem: p for p in root.glob("*.py")}
    for folder in FOLDERS:
        for p in (root / folder).glob("*.py"):
            modules[folder if p.stem == "__init__" else f"{folder}.{p.stem}"] = p
    return modules


def path_folders(tree: ast.Module) -> list:
    """The project folders a file puts on sys.path by name (gpu_check.py: REPO / "tests")."""
    folders = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            changed = ast.unparse(node.func.value)  # sys.path.insert(0, ...)
        elif isinstance(node, ast.Assign):
            changed = " ".join(ast.unparse(t) for t in node.targets)  # sys.path[:0] = [...]
        else:
            continue
        if changed.startswith("sys.path"):
            folders += [c.value for c in ast.walk(node)
                        if isinstance(c, ast.Constant) and c.value in FOLDERS]
    return folders


def resolve(name: str, folders: list, modules: dict):
    """The project module that an absolute import of `name` loads, or None (another package). Its
    first part is looked up as Python does for a script: in its own folder first (a script's folder
    is sys.path[0]), then in the folders it puts on sys.path, then at the top level; then the
    longest prefix that is a project module ("scripts.rundir" for "scripts.rundir.Run")."""
    first = name.split(".")[0]
    for folder in folders:
        if f"{folder}.{first}" in modules:
            name = f"{folder}.{name}"
            break
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def arrows(root: Path) -> dict:
    """{module: {the project modules it imports}}, over every import statement at any depth."""
    modules = project_modules(root)
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = module if path.stem == "__init__" else module.rpartition(".")[0]
        folders = ([package] if package else []) + path_folders(tree)
        names = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from its package (scripts/x.py's "." is scripts)
                    parts = package.split(".")
                    up = [p for p in parts[:len(parts) - node.level + 1] if p]
                    base = ".".join(up + ([base] if base else []))
                # `from scripts import plot` loads the module scripts.plot, `from x import f` x
                names += [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
        targets = {resolve(name, folders, modules) for name in names if name}
        # a file naming itself (import trace inside trace.py) is no circle between two files
        graph[module] = {t for t in targets if t and t != module}
    return graph


def tangles(graph: dict) -> list:
    """The strongly connected groups of more than one module (Tarjan): each module of a group
    reaches every other one, so each lies on a cycle."""
    index = {}
    low = {}
    stack = []
    groups = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:  # v is the first of its group that the walk reached
            group = set()
            while v not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def shortest_cycle(graph: dict, group: set) -> list:
    """The shortest way from the group's first module back to itself (breadth first), that module
    at both ends."""
    start = min(group)
    came_from = {start: None}
    frontier = [start]
    while not any(start in graph[v] for v in frontier):
        reached = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w not in came_from:
                    came_from[w] = v
                    reached.append(w)
        frontier = reached
    cycle = [start]
    last = next(v for v in frontier if start in graph[v])
    while last != start:
        cycle.insert(1, last)
        last = came_from[last]
    return cycle + [start]


def find_cycles(root: Path) -> list:
    """[(a cycle, every module of its group)] as file paths: [] when the arrows run one way."""
    graph = arrows(root)
    modules = project_modules(root)
    path = lambda m: str(modules[m].relative_to(root))  # noqa: E731
    return sorted(([path(m) for m in shortest_cycle(graph, group)], sorted(map(path, group)))
                  for group in tangles(graph))


def describe(cycles) -> str:
    lines = [f"{' -> '.join(cycle)} (the circle holds {', '.join(group)})"
             for cycle, group in cycles]
    return "import cycles:\n" + "\n".join(lines)


# --- the project ---------------------------------------------------------------------------------

def test_no_import_cycle():
    cycles = find_cycles(REPO)
    assert not cycles, describe(cycles)


def test_the_arrows_run_one_way():
    """Launching reaches the model and the reader, not the plots; the reader reaches nothing."""
    graph = arrows(REPO)
    assert graph["scripts.rundir"] == set(), graph["scripts.rundir"]
    # the fault layer reaches the weight group's code and the journal's reader, never a role; vLLM
    # loads weights_sync by name in its workers, which must not pull in the fault layer, at any depth
    assert graph["elastic"] <= {"weights_sync", "common", "scripts.rundir"}, graph["elastic"]
    reached, todo = set(), ["weights_sync"]
    while todo:
        for w in graph[todo.pop()] - reached:
            reached.add(w)
            todo.append(w)
    assert "elastic" not in reached and not reached & {"actor", "trainer", "verifier"}, reached
    assert {"scripts.throughput_model", "scripts.rundir"} <= graph["scripts.launch"]
    for module in ("scripts.plot", "scripts.trace", "scripts.throughput_model",
                   "bench.longtail_model"):
        assert "scripts.rundir" in graph[module], module
    reached = set()
    todo = ["scripts.launch"]
    while todo:
        for w in graph[todo.pop()] - reached:
            reached.add(w)
            todo.append(w)
    assert not reached & {"scripts.plot", "scripts.trace"}, reached


# --- the checker itself, on a made-up tree -------------------------------------------------------

def write(root: Path, files: dict) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_every_import_form_is_an_arrow(tmp_path):
    root = write(tmp_path, {
        "core.py": "import json\n",
        "scripts/__init__.py": "",
        "scripts/a.py": "from scripts.b import f\n",
        "scripts/b.py": "def f():\n    from scripts import c\n",
        "scripts/c.py": "import scripts.d as d\nimport trace\n",
        "scripts/d.py": "import sys\nsys.path.insert(0, HERE)\nimport e\n",
        "scripts/e.py": "if True:\n    from . import core_user\n",
        "scripts/core_user.py": "import core\nfrom .a import x\n",
        "bench/g.py": 'import sys\nsys.path[:0] = [str(REPO / "tests")]\nfrom conftest import x\n',
        "tests/conftest.py": "from scripts.d import y\n",
    })
    graph = arrows(root)
    assert graph["scripts.a"] == {"scripts.b"}
    assert graph["scripts.b"] == {"scripts.c"}
    assert graph["scripts.c"] == {"scripts.d"}  # no scripts/trace.py here: the standard library's
    assert graph["scripts.d"] == {"scripts.e"}
    assert graph["scripts.e"] == {"scripts.core_user"}
    assert graph["scripts.core_user"] == {"core", "scripts.a"}
    assert graph["bench.g"] == {"tests.conftest"}
    assert graph["core"] == set()
    cycle = ["scripts/a.py", "scripts/b.py", "scripts/c.py", "scripts/d.py", "scripts/e.py",
             "scripts/core_user.py", "scripts/a.py"]
    assert find_cycles(root) == [(cycle, sorted(cycle[:-1]))]


def test_one_way_arrows_pass_and_each_cycle_is_named(tmp_path):
    root = write(tmp_path, {
        "scripts/launch.py": "from scripts.model import r\nfrom scripts.reader import read\n",
        "scripts/model.py": "from scripts.reader import read\n",
        "scripts/reader.py": "import json\n",
        "bench/x.py": "from scripts.model import r\n",
    })
    assert find_cycles(root) == []
    write(root, {"scripts/reader.py": "def read():\n    from scripts.launch import helper\n",
                 "bench/y.py": "import z\n", "bench/z.py": "def f():\n    import y\n"})
    # launch -> model -> reader -> launch, launch -> reader -> launch: one group, the shorter named
    bench = ["bench/y.py", "bench/z.py", "bench/y.py"]
    launch = ["scripts/launch.py", "scripts/reader.py", "scripts/launch.py"]
    group = ["scripts/launch.py", "scripts/model.py", "scripts/reader.py"]
    assert find_cycles(root) == [(bench, bench[:2]), (launch, group)]
    assert "scripts/launch.py -> scripts/reader.py -> scripts/launch.py (the circle holds " \
        "scripts/launch.py, scripts/model.py, scripts/reader.py)" in describe(find_cycles(root))
