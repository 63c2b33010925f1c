"""The package's layout is its architecture: rooms by concern, imports one way, small modules.

Read from the source (every import, those inside functions included), never by importing it.
"""
import ast
import pathlib

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOUNDATION = {"gradsched.plan", "gradsched.options", "gradsched.user_errors"}  # plain data and errors
# each room may import itself and the rooms before it; the public API (the rest of gradsched's top level) any
ROOMS = ["gradsched.passes", "foundation", "gradsched.cp", "gradsched.sync", "gradsched.tp", "gradsched.training",
         "gradsched.sizing"]
MAX_LINES, MAX_TOP_LEVEL = 400, 12


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted((ROOT / "gradsched").rglob("*.py")) + sorted((ROOT / "passes").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "passes":  # installed as gradsched.passes
            parts = ["gradsched", *parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: pathlib.Path, known: set) -> set:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                out.add(target if target in known else base)
        elif isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
    return {t for t in out if t in known and t != name}


def import_graph() -> nx.DiGraph:
    found = modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(found)
    for name, path in found.items():
        graph.add_edges_from((name, t) for t in imports(name, path, set(found)))
    return graph


def room(name: str) -> str:
    if name in FOUNDATION:
        return "foundation"
    for r in ROOMS:
        if r.startswith("gradsched.") and (name == r or name.startswith(r + ".")):
            return r
    return "api"


def test_no_module_imports_itself_back_through_others():
    graph = import_graph()
    # a package's __init__ that re-exports its modules is not a cycle through them
    graph.remove_edges_from([(a, b) for a, b in list(graph.edges) if b.startswith(a + ".")])
    cycles = [c for c in nx.simple_cycles(graph) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"


def test_each_room_imports_only_the_rooms_below_it():
    wrong = []
    for a, b in import_graph().edges:
        ra, rb = room(a), room(b)
        if ra == "api" or ra == rb:
            continue
        if rb == "api" or ROOMS.index(rb) > ROOMS.index(ra):
            wrong.append(f"{a} ({ra}) imports {b} ({rb})")
    assert not wrong, "\n".join(wrong)


def test_no_module_is_longer_than_400_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_package_top_level_holds_at_most_12_modules():
    top = sorted(p.name for p in (ROOT / "gradsched").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top


def test_every_subpackage_says_what_it_owns_and_what_it_may_import():
    for init in [*(ROOT / "gradsched").glob("*/__init__.py"), ROOT / "passes" / "__init__.py"]:
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert "import" in doc and len(doc.splitlines()) >= 3, f"{init.relative_to(ROOT)}: {doc!r}"


def readme_tree() -> set[str]:
    """The files docs/design.md's tree lists (the first code block after "### The tree"), as paths."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = text[text.index("### The tree"):].split("```", 2)[1]
    paths, folders = set(), []  # folders: (indent, name) of the open folders
    for line in block.splitlines():
        if not line.strip():
            continue
        indent, entry = len(line) - len(line.lstrip()), line.split()[0]
        folders = [(i, f) for i, f in folders if i < indent]
        if entry.endswith("/"):
            folders.append((indent, entry))
        else:
            paths.add("".join(f for _, f in folders) + entry)
    return paths


def test_the_readme_tree_is_the_package():
    files = {p.relative_to(ROOT).as_posix() for p in [*(ROOT / "gradsched").rglob("*.py"), *(ROOT / "passes").rglob("*.py")]}
    listed = readme_tree()
    assert not files - listed, f"modules docs/design.md's tree does not show: {sorted(files - listed)}"
    assert not listed - files, f"docs/design.md's tree shows files that do not exist: {sorted(listed - files)}"


def test_the_parallel_model_is_thin_and_its_parts_small():
    parallel = len((ROOT / "gradsched" / "parallel.py").read_text().splitlines())
    assert parallel < 150, f"gradsched/parallel.py: {parallel} lines; its jobs belong in training/'s modules"
    # the modules the making of room for a new dimension changed: each at most 300 lines
    parts = ["training/pipeline_build", "training/step_driver", "training/model_state", "training/stage_values",
             "backend", "sync/runtime", "sync/stage_results", "sync/stage_build", "sync/rank_stages",
             "sync/pass_pipeline", "sync/sync_graphs", "sync/compile", "sync/preflight", "sync/sync_plan"]
    long = {p: n for p in parts if (n := len((ROOT / "gradsched" / f"{p}.py").read_text().splitlines())) > 300}
    assert not long, long


def test_training_sees_a_parallel_model_only_through_its_model_state():
    # duck-typing a ParallelModel's attributes hides the interface: ask gradsched.training.model_state instead
    probes = ('getattr(type(model)', 'hasattr(model, "grad_sync")', 'getattr(model, "options"')
    found = [f"{name}: {probe}" for name, path in modules().items()
             if name.startswith(("gradsched.training", "gradsched.sync")) for probe in probes
             if probe in path.read_text()]
    assert not found, found
