"""The package's layout: the runtime never imports the tooling, no import cycle between
modules (so none between subpackages), and no import upward across the layers (LAYERS,
written once here; docs/layout.md draws them).

Runtime: what training imports (engine, compression, collectives, pipeline, common, torch,
tensorflow, keras, and the top-level package with preemption). Tooling: pipe_horovod.tools
(the CLI, benchmarks, workloads, the emulated cluster, the planner). The graph is read
from the sources with ast, so an import inside a function counts as much as one at the top.
"""
import ast
import collections
import importlib.util
import json
import subprocess
import sys
from pathlib import Path


PACKAGE = Path(__file__).resolve().parent.parent / "pipe_horovod"
RUNTIME = ("engine", "pipeline", "compression", "collectives", "common", "_keras", "torch",
           "keras", "tensorflow")
TOOLS = "pipe_horovod.tools"
# Alias modules the package once had (each re-exported a tooling module); removed: a 0.1.0
# package keeps one name per idea.
REMOVED_ALIASES = ("pipe_horovod.emulate", "pipe_horovod.timing")

# The layers, bottom first, as Horovod's (horovod/common under torch and tensorflow, keras on
# top): a module may import modules of its own unit and of units in lower layers only, never
# of a unit in its own layer or above. Units: the subpackages of pipe_horovod by name,
# "pipe_horovod" for the package's own __init__ and "preemption" for that module.
# engine and compression import nothing of pipe_horovod; collectives runs on both; the
# pipeline core on those three; common (what every adapter shares) on the four; _keras (the
# pipelined Keras optimizer, Horovod's horovod/_keras) on common, never on an adapter; the
# adapters on common (tensorflow also on _keras; keras on _keras and on torch and
# tensorflow: its two backends); the tooling on the whole runtime. Nothing in the runtime
# imports keras but keras.
LAYERS = (
    ("engine", "compression"),
    ("collectives",),
    ("pipeline",),
    ("common", "preemption"),
    ("_keras",),
    ("torch", "tensorflow", "pipe_horovod"),
    ("keras",),
    ("tools",),
)


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
    # Importing a.b.c runs the __init__ of a.b (and of a) first: an import of another
    # package's module imports that package too. The importer's own packages are not
    # counted: they are loaded (or loading) whenever it runs.
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
    if is_init:
        own.add(name)
    for target in list(out):
        parts = target.split(".")
        out.update(p for p in (".".join(parts[:i]) for i in range(1, len(parts)))
                   if p not in own)
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
    return name == TOOLS or name.startswith(TOOLS + ".")


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
    """The alias modules are gone (scripts import pipe_horovod.tools.emulate and
    pipe_horovod.tools.planner), and no module of the runtime stands in for the tooling."""
    _, modules = _graph()
    for alias in REMOVED_ALIASES:
        assert alias not in modules and importlib.util.find_spec(alias) is None, alias


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


def test_no_import_cycle_between_modules():
    """Module by module, runtime and tooling alike: a package's __init__ is a module too,
    so a submodule importing its package back (`from . import name`) is a cycle."""
    graph, _ = _graph()
    cycle = _cycle(graph)
    assert cycle is None, "import cycle between modules: " + " -> ".join(cycle)


def _layer_unit(name):
    """The unit of LAYERS a module belongs to."""
    parts = name.split(".")
    if len(parts) == 1:
        return "pipe_horovod"
    return parts[1]


def _layer_of():
    return {unit: level for level, units in enumerate(LAYERS) for unit in units}


def _upward_imports(graph):
    level = _layer_of()
    found = []
    for m, targets in sorted(graph.items()):
        a = _layer_unit(m)
        for t in sorted(targets):
            b = _layer_unit(t)
            if a != b and level[b] >= level[a]:
                found.append(f"{m} ({a}) -> {t} ({b})")
    return found


def test_every_module_has_a_layer():
    graph, _ = _graph()
    level = _layer_of()
    unplaced = sorted({_layer_unit(m) for m in graph} - set(level))
    assert not unplaced, f"units in no layer of LAYERS: {unplaced}"
    assert len(level) == sum(map(len, LAYERS)), "a unit named in two layers"


def test_no_import_goes_up_or_across_the_layers():
    graph, _ = _graph()
    found = _upward_imports(graph)
    assert not found, ("imports of a unit in the same layer or above (LAYERS):\n"
                       + "\n".join(found))


def test_the_layer_check_finds_upward_and_sideways_imports():
    graph = {"pipe_horovod.engine.x": {"pipe_horovod.common.y"},          # up
             "pipe_horovod.torch.a": {"pipe_horovod.tensorflow.b",        # across
                                      "pipe_horovod.common.y"},           # down: fine
             "pipe_horovod.common.y": {"pipe_horovod.engine.x"},          # down: fine
             "pipe_horovod.keras.k": {"pipe_horovod.keras.l"}}            # own unit: fine
    assert _upward_imports(graph) == [
        "pipe_horovod.engine.x (engine) -> pipe_horovod.common.y (common)",
        "pipe_horovod.torch.a (torch) -> pipe_horovod.tensorflow.b (tensorflow)"]


def test_tensorflow_imports_neither_keras_nor_torch():
    """pipe_horovod.tensorflow stands on common (as horovod.tensorflow on horovod/common):
    neither the Keras adapter nor the PyTorch adapter, read from the sources and as
    loaded (torch the library it does use: the bridge's DLPack and the engines)."""
    graph, _ = _graph()

    def arrows(graph):
        return sorted(f"{m} -> {t}" for m, targets in graph.items()
                      if m == "pipe_horovod.tensorflow"
                      or m.startswith("pipe_horovod.tensorflow.")
                      for t in targets if t.split(".")[1:2] in (["keras"], ["torch"]))
    found = arrows(graph)
    assert not found, "pipe_horovod.tensorflow imports another adapter:\n" + "\n".join(found)
    if importlib.util.find_spec("tensorflow") is None:
        return
    code = ("import json, sys\nimport pipe_horovod.tensorflow\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('pipe_horovod.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    others = [m for m in loaded if m.split(".")[1] in ("keras", "torch")]
    assert not others, f"import pipe_horovod.tensorflow loaded {others}"


def test_importing_a_module_counts_its_package_init(tmp_path, monkeypatch):
    """`from ..b.thing import x` runs b/__init__.py too, so a circle through a package's
    __init__ is found; the importer's own package is not counted (it is loaded already)."""
    root = tmp_path / "pipe_horovod"
    for package, files in {"a": {"__init__.py": "from ..b.thing import x\n",
                                 "other.py": "y = 1\n"},
                           "b": {"__init__.py": "from . import thing\n",
                                 "thing.py": "from ..a.other import y\nx = y\n"}}.items():
        (root / package).mkdir(parents=True)
        for file, text in files.items():
            (root / package / file).write_text(text)
    (root / "__init__.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", root)
    graph, _ = _graph()
    assert graph["pipe_horovod.b.thing"] == {"pipe_horovod.a", "pipe_horovod.a.other"}
    assert graph["pipe_horovod.b"] == {"pipe_horovod.b.thing"}
    assert _cycle(graph) == ["pipe_horovod.a", "pipe_horovod.b", "pipe_horovod.b.thing",
                             "pipe_horovod.a"]


def test_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_importing_the_adapters_loads_no_tooling():
    code = """
import importlib.util, json, sys
import pipe_horovod.torch
if importlib.util.find_spec("keras") is not None:
    import pipe_horovod.keras
if importlib.util.find_spec("tensorflow") is not None:
    import pipe_horovod.tensorflow
print(json.dumps(sorted(m for m in sys.modules if m.startswith("pipe_horovod"))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert "pipe_horovod.torch" in loaded
    tooling = [m for m in loaded if _is_tooling(m)]
    assert not tooling, f"import pipe_horovod.torch, pipe_horovod.keras loaded {tooling}"


# --- no private name crosses packages ------------------------------------------------
# Adapters talk to the shared core, and to each other, through public methods. Read
# statically, a private name (one leading underscore, not a dunder) crosses packages
# when a module of one package (its directory: pipe_horovod.torch and
# pipe_horovod.torch.elastic are two) uses one that only another package defines:
#   obj._name        an attribute (a method, or `self._name = ...`) of another package's class;
#   module._name     a module-level name of another package's module (`from ..torch import
#                    optimizer as o; o._name`), or `from ..torch.optimizer import _name`;
#   getattr(obj, "_name"), hasattr/setattr/delattr alike;
#   f(_name=...)     a private keyword of another package's function.
# A private name that the module's own package defines too is not counted (it may
# well be its own), and neither is any name pipe_horovod does not define (torch's
# `tensor._version`, say). Checked for every module: the runtime, the tooling's use of
# the runtime, and the tooling's subpackages among themselves (tools.bench,
# tools.commands, tools.emulate, tools.workloads, and the modules directly in tools/).

def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _package_of(name, modules):
    """The package a module belongs to: itself for a package __init__, else its parent."""
    return name if modules[name][1] else name.rsplit(".", 1)[0]


def _module_source(name, is_init, node):
    """The absolute module an ImportFrom names."""
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_init else name.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _definitions(modules, trees):
    """{private name: packages defining it} as an attribute (methods, class-level names,
    `self.x =`/`cls.x =`), as a parameter, and as a module-level name, kept apart."""
    attributes, parameters = collections.defaultdict(set), collections.defaultdict(set)
    module_level = {}
    for name, tree in trees.items():
        package = _package_of(name, modules)
        top = set()
        for node in tree.body:
            for sub in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    top.add(sub.name)
                elif isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                    targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target]
                    top.update(n.id for t in targets for n in ast.walk(t)
                               if isinstance(n, ast.Name))
        module_level[name] = top
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        attributes[item.name].add(package)
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                        for t in targets:
                            if isinstance(t, ast.Name):
                                attributes[t.id].add(package)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                attributes[node.attr].add(package)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                args = node.args
                for arg in args.posonlyargs + args.args + args.kwonlyargs:
                    parameters[arg.arg].add(package)
    return attributes, parameters, module_level


def _private_crossings(checked=lambda name: True):
    """'module:line: what' for each private name a `checked` module takes from another
    package."""
    modules = _modules()
    trees = {name: ast.parse(path.read_text(), str(path))
             for name, (path, _) in modules.items()}
    attributes, parameters, module_level = _definitions(modules, trees)
    found = []
    for name, tree in sorted(trees.items()):
        if not checked(name):
            continue
        package, is_init = _package_of(name, modules), modules[name][1]
        aliases = {}                     # local name -> pipe_horovod module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update((a.asname, a.name) for a in node.names
                               if a.asname and a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                source = _module_source(name, is_init, node)
                if source not in modules:
                    continue
                for a in node.names:
                    if f"{source}.{a.name}" in modules:
                        aliases[a.asname or a.name] = f"{source}.{a.name}"
                    elif _private(a.name) and _package_of(source, modules) != package:
                        found.append(f"{name}:{node.lineno}: from {source} import {a.name}")

        def other(owners):               # defined by pipe_horovod, not by this package
            return owners and package not in owners

        for node in ast.walk(tree):
            where = f"{name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Attribute) and _private(node.attr):
                target = aliases.get(node.value.id) if isinstance(node.value, ast.Name) else None
                if target is not None:
                    if _package_of(target, modules) != package:
                        found.append(f"{where}: {target}.{node.attr}")
                elif other(attributes.get(node.attr)):
                    found.append(f"{where}: ._{node.attr[1:]} of "
                                 f"{', '.join(sorted(attributes[node.attr]))}")
            elif isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Name) and func.id in (
                        "getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1 and \
                        isinstance(node.args[1], ast.Constant) and \
                        isinstance(node.args[1].value, str) and _private(node.args[1].value):
                    attr = node.args[1].value
                    if other(attributes.get(attr)):
                        found.append(f"{where}: {func.id}(..., {attr!r}) of "
                                     f"{', '.join(sorted(attributes[attr]))}")
                for keyword in node.keywords:
                    if keyword.arg and _private(keyword.arg) and \
                            other(parameters.get(keyword.arg)):
                        found.append(f"{where}: keyword {keyword.arg}= of "
                                     f"{', '.join(sorted(parameters[keyword.arg]))}")
    return found


def test_no_private_name_crosses_packages():
    found = _private_crossings()
    assert not found, ("a private name used outside the package that defines it (give "
                       "that package a public, documented method instead):\n" + "\n".join(found))


def test_private_crossings_are_found(tmp_path, monkeypatch):
    """The check above sees each kind of crossing (on a small package of its own)."""
    root = tmp_path / "pipe_horovod"
    (root / "core").mkdir(parents=True)
    (root / "user").mkdir()
    (root / "__init__.py").write_text("")
    (root / "core" / "__init__.py").write_text("")
    (root / "core" / "thing.py").write_text(
        "_table = {}\n"
        "class Thing:\n"
        "    def __init__(self):\n"
        "        self._count = 0\n"
        "    def _hidden(self):\n"
        "        pass\n"
        "def make(x, _secret=None):\n"
        "    return Thing()\n")
    (root / "user" / "__init__.py").write_text("")
    (root / "user" / "use.py").write_text(
        "from ..core import thing as t\n"
        "from ..core.thing import _table\n"
        "def f(obj):\n"
        "    obj._hidden()\n"
        "    getattr(obj, '_count')\n"
        "    t._table.clear()\n"
        "    t.make(1, _secret=2)\n"
        "    obj._version\n"                  # defined nowhere here: not ours
        "    obj.__class__\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", root)
    found = _private_crossings(checked=lambda m: m.startswith("pipe_horovod.user"))
    text = "\n".join(found)
    for expected in (":2: from pipe_horovod.core.thing import _table", ":4: ._hidden",
                     ":5: getattr(..., '_count')", ":6: pipe_horovod.core.thing._table",
                     ":7: keyword _secret="):
        assert expected in text, (expected, text)
    assert len(found) == 5, text
