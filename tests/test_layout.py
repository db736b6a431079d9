"""The package's layout: the runtime never imports the tooling, and no import cycle
between subpackages (issue 26).

Runtime: what training imports (engine, pipeline, compression, collectives, torch,
keras, and the top-level package with preemption). Tooling: pipe_horovod.tools
(the CLI, benchmarks, workloads, the emulated cluster, the planner). The graph is
read from the sources with ast, so an import inside a function counts as much as
one at the top.
"""
import ast
import collections
import json
import subprocess
import sys
from pathlib import Path


PACKAGE = Path(__file__).resolve().parent.parent / "pipe_horovod"
RUNTIME = ("engine", "pipeline", "compression", "collectives", "torch", "keras")
TOOLS = "pipe_horovod.tools"
# Old names kept so users' scripts keep working; each only re-exports the tooling.
ALIASES = {"pipe_horovod.emulate": "pipe_horovod.tools.emulate",
           "pipe_horovod.timing": "pipe_horovod.tools.planner"}


def _modules():
    """{module name: (source path, is a package __init__)} of every module in the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ["pipe_horovod", *path.relative_to(PACKAGE).with_suffix("").parts]
        is_init = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_init else parts)] = (path, is_init)
    return found


def _imports(name, path, is_init, modules):
    """The pipe_horovod modules `name` imports anywhere in its source."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("pipe_horovod"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_init else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not source.startswith("pipe_horovod"):
                continue
            for alias in node.names:     # `from pkg import submodule` imports the submodule
                sub = f"{source}.{alias.name}"
                out.add(sub if sub in modules else source)
    return {m for m in out if m in modules}


def _graph():
    modules = _modules()
    return {name: _imports(name, path, is_init, modules)
            for name, (path, is_init) in modules.items()}, modules


def _unit(name, modules):
    """The node a module collapses to: its subpackage of pipe_horovod (engine, torch,
    tools, ...) or itself for a module directly in pipe_horovod/ (preemption, the
    aliases)."""
    return ".".join(name.split(".")[:2])


def _tool_unit(name, modules):
    """Inside pipe_horovod.tools: its subpackage (bench, commands, emulate, workloads)
    or the module itself (cli, planner, hop_codecs)."""
    parts = name.split(".")
    package = ".".join(parts[:3])
    return package if package in modules and modules[package][1] else name


def _is_runtime(name):
    return (name in ("pipe_horovod", "pipe_horovod.preemption")
            or any(name == f"pipe_horovod.{p}" or name.startswith(f"pipe_horovod.{p}.")
                   for p in RUNTIME))


def _is_tooling(name):
    return name == TOOLS or name.startswith(TOOLS + ".") or name in ALIASES


def _cycle(edges):
    """One cycle of the directed graph `edges` as a list of nodes, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_every_module_is_runtime_or_tooling():
    _, modules = _graph()
    assert modules, PACKAGE
    neither = sorted(m for m in modules if not _is_runtime(m) and not _is_tooling(m))
    assert not neither, f"modules outside both the runtime and pipe_horovod.tools: {neither}"


def test_no_runtime_module_imports_the_tooling():
    graph, _ = _graph()
    arrows = sorted(f"{m} -> {t}" for m, targets in graph.items() if _is_runtime(m)
                    for t in targets if _is_tooling(t))
    assert not arrows, "the runtime imports the tooling:\n" + "\n".join(arrows)


def test_aliases_only_point_into_the_tooling():
    graph, _ = _graph()
    for alias, target in ALIASES.items():
        assert graph[alias] == {target}, (alias, graph[alias])


def _collapsed(graph, unit, keep=lambda m: True):
    edges = collections.defaultdict(set)
    for m, targets in graph.items():
        for t in targets:
            if keep(m) and keep(t):
                a, b = unit(m), unit(t)
                if a != b:
                    edges[a].add(b)
    return edges


def test_no_import_cycle_between_subpackages():
    graph, modules = _graph()
    cycle = _cycle(_collapsed(graph, lambda m: _unit(m, modules)))
    assert cycle is None, "import cycle between subpackages: " + " -> ".join(cycle)


def test_no_import_cycle_between_tooling_subpackages():
    graph, modules = _graph()
    in_tools = lambda m: m.startswith(TOOLS + ".")  # noqa: E731
    cycle = _cycle(_collapsed(graph, lambda m: _tool_unit(m, modules), in_tools))
    assert cycle is None, "import cycle inside pipe_horovod.tools: " + " -> ".join(cycle)


def test_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_importing_the_adapters_loads_no_tooling():
    code = """
import importlib.util, json, sys
import pipe_horovod.torch
if importlib.util.find_spec("keras") is not None:
    import pipe_horovod.keras
print(json.dumps(sorted(m for m in sys.modules if m.startswith("pipe_horovod"))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "pipe_horovod.torch" in loaded
    tooling = [m for m in loaded if _is_tooling(m)]
    assert not tooling, f"import pipe_horovod.torch, pipe_horovod.keras loaded {tooling}"
