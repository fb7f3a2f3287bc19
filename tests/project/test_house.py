"""The house rules, read from the source with ``ast``: no module imports a private name of
another module, every package's ``__init__`` states its responsibility and curates its names, and
the config is read once: the core imports nothing of the config (nor the engine, which translates
it), and the config nothing of the core; the memory estimator imports neither the engine nor
the demo's model; no import cycle; no public function takes more than eight parameters.

A private name (``_x``) is its module's own: a name a sibling module needs is a public name of
its module (a private module, ``jzero.config._common``, may have public names), and a name
another package needs is public API of its package. Imports inside functions count too.
"""

import ast
from collections.abc import Callable
from pathlib import Path

from repo import ROOT

JZERO = ROOT / "jzero"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str, root: Path) -> bool:
    path = root.parent / Path(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def private_imports(root: Path, *, siblings: bool = False) -> list[str]:
    """``file:line name from module`` for each private name a module imports from a module of
    another package (the package of ``jzero.a.b`` is ``jzero.a``; of ``jzero.a`` (a module
    directly under ``jzero/``) ``jzero``; a package's ``__init__`` is in its own package).
    ``siblings``: from any other module, its own package's too (a private module imported by
    name, ``from jzero.a import _b``, is no private name of ``jzero.a``)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        name = _module_name(path, root)
        here = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != root.name:
                continue
            is_package = (root.parent / Path(*source.split(".")) / "__init__.py").is_file()
            source_package = source if is_package else source.rsplit(".", 1)[0]
            if source_package == here and not siblings:
                continue
            for alias in node.names:
                if siblings and _is_module(f"{source}.{alias.name}", root):
                    continue
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(
                        f"{path.relative_to(root.parent)}:{node.lineno} {alias.name} from {source}"
                    )
    return found


def jzero_imports(root: Path, *, run: bool = False, typing: bool = True) -> list[tuple[str, str]]:
    """``(file:line, module)`` for each module of ``root``'s package that a module imports
    (``from a.b import c`` names ``a.b``; a relative import is resolved), anywhere in it.
    ``run``: the modules the import runs instead: ``from a.b import c`` names ``a.b.c`` where
    that is a module (and ``a.b`` for the names that are not), and a call
    ``importlib.import_module("a.b")`` names ``a.b``. ``typing=False`` leaves out the imports
    under a top-level ``if TYPE_CHECKING:``, which only type checkers read."""
    found = []
    for path in sorted(root.rglob("*.py")):
        name = _module_name(path, root)
        here = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(), str(path))
        skip = set() if typing else _under_type_checking(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                sources = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    sources = [".".join(base + ([node.module] if node.module else []))]
                else:
                    sources = [node.module or ""]
                if run:
                    subs = [f"{sources[0]}.{a.name}" for a in node.names]
                    subs = [m for m in subs if _is_module(m, root)]
                    sources = subs + (sources if len(subs) < len(node.names) else [])
            elif run and _imports_by_name(node):
                sources = [node.args[0].value]
            else:
                continue
            where = f"{path.relative_to(root.parent)}:{node.lineno}"
            found += [(where, s) for s in sources if s.split(".")[0] == root.name]
    return found


def _under_type_checking(tree: ast.Module) -> set[int]:
    """The ``id`` of every node under the module's top-level ``if TYPE_CHECKING:`` blocks."""
    return {
        id(node)
        for block in tree.body
        if isinstance(block, ast.If) and _called(block.test) == "TYPE_CHECKING"
        for stmt in block.body
        for node in ast.walk(stmt)
    }


def _imports_by_name(node: ast.AST) -> bool:
    """Whether ``node`` is ``importlib.import_module("...")`` (or ``import_module("...")``)."""
    return (
        isinstance(node, ast.Call)
        and _called(node.func) == "import_module"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    )


def _under(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


CORE = (
    "jzero.plan",
    "jzero.rewrite",
    "jzero.parallel",
    "jzero.step",
    "jzero.comm",
    "jzero.subgroups",
)


def forbidden_imports(root: Path) -> list[str]:
    """The imports that cross the config's wall: the core (plan, rewrite, the parallelisms,
    step, comm, groups) importing the config or the engine (whose ``settings`` translates
    it), and the config or the choices it validates against importing anything of jzero's
    but themselves and ``jzero._util``."""
    name = root.name
    core = tuple(p.replace("jzero", name, 1) for p in CORE)
    config_side = (f"{name}.config", f"{name}.choices")
    found = []
    for where, source in jzero_imports(root):
        module = _module_name(root.parent / where.split(":")[0], root)
        if _under(module, core) and _under(source, (f"{name}.config", f"{name}.engine")):
            found.append(f"{where} {source}")
        if _under(module, config_side) and not _under(source, (*config_side, f"{name}._util")):
            found.append(f"{where} {source}")
    return found


ABOVE_MEMORY = ("jzero.engine", "jzero.demo")


def memory_imports_above(root: Path) -> list[str]:
    """The imports that lift the memory estimator above what it measures: ``jzero.memory``
    importing the engine or the demo's model, data or loop.
    Its measured report takes an engine, and :func:`jzero.memory.measure_stages` a model, from
    the caller; ``plan_report`` (the built-in GPT's) is reached by name, adding no import."""
    return _imports_into(root, "jzero.memory", ABOVE_MEMORY)


def _imports_into(root: Path, package: str, above: tuple[str, ...]) -> list[str]:
    """``file:line module`` for each import of a module under ``above`` by a module of
    ``package`` (both named as in ``jzero``, read in ``root``'s package)."""
    name = root.name
    inside = package.replace("jzero", name, 1)
    outside = tuple(p.replace("jzero", name, 1) for p in above)
    found = []
    for where, source in jzero_imports(root):
        module = _module_name(root.parent / where.split(":")[0], root)
        if _under(module, (inside,)) and _under(source, outside):
            found.append(f"{where} {source}")
    return found


def test_the_memory_estimator_imports_no_engine_and_no_model():
    assert memory_imports_above(JZERO) == []


def planted(tmp_path: Path, subs: tuple[str, ...], init: str = '"""The package."""\n') -> Path:
    """A planted ``jzero`` package under ``tmp_path`` for a check's companion test: the
    subpackages ``subs``, each with a docstring ``__init__``, and the top ``__init__`` ``init``."""
    pkg = tmp_path / "jzero"
    for sub in subs:
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text('"""A package."""\n')
    (pkg / "__init__.py").write_text(init)
    return pkg


def test_the_memory_check_finds_an_engine_or_a_model_imported(tmp_path):
    pkg = planted(tmp_path, ("memory", "engine", "demo", "plan"))
    (pkg / "memory" / "a.py").write_text(
        "from jzero.plan import make_plan\n\n\ndef f():\n    from jzero.engine import initialize\n"
    )
    (pkg / "memory" / "b.py").write_text("import jzero.demo.gpt\nfrom ..demo import gpt\n")
    (pkg / "engine" / "c.py").write_text("from jzero.memory import estimate\n")
    assert memory_imports_above(pkg) == [
        "jzero/memory/a.py:5 jzero.engine",
        "jzero/memory/b.py:1 jzero.demo.gpt",
        "jzero/memory/b.py:2 jzero.demo",
    ]


def test_the_core_and_the_config_import_nothing_of_each_other():
    assert forbidden_imports(JZERO) == []


def test_the_import_check_finds_the_core_reading_the_config_and_back(tmp_path):
    pkg = planted(tmp_path, ("config", "plan", "step", "choices", "parallel", "engine"))
    (pkg / "plan" / "a.py").write_text("from jzero.choices import stages\nimport jzero.config\n")
    (pkg / "step" / "b.py").write_text("def f():\n    from ..engine import settings\n")
    (pkg / "config" / "c.py").write_text(
        "from jzero._util import read_size\nfrom jzero.choices import stages\n"
        "from jzero.parallel import pipeline\n"
    )
    (pkg / "choices" / "d.py").write_text("from jzero.plan import a\n")
    assert forbidden_imports(pkg) == [
        "jzero/choices/d.py:1 jzero.plan",
        "jzero/config/c.py:3 jzero.parallel",
        "jzero/plan/a.py:2 jzero.config",
        "jzero/step/b.py:2 jzero.engine",
    ]


def test_no_private_name_is_imported_from_another_package():
    assert private_imports(JZERO) == []


def test_the_check_finds_a_private_import_from_another_package(tmp_path):
    pkg = planted(tmp_path, ("a", "b"), init='"""A package."""\n')
    (pkg / "a" / "x.py").write_text("def _hidden():\n    pass\n\n\ndef shown():\n    pass\n")
    (pkg / "a" / "y.py").write_text("from jzero.a.x import _hidden\nfrom .x import _hidden as h\n")
    (pkg / "b" / "z.py").write_text(
        "from jzero.a.x import shown\n\n\ndef f():\n    from jzero.a.x import _hidden\n"
    )
    (pkg / "b" / "w.py").write_text("from ..a.x import _hidden\n")
    assert private_imports(pkg) == [
        "jzero/b/w.py:1 _hidden from jzero.a.x",
        "jzero/b/z.py:5 _hidden from jzero.a.x",
    ]


def test_every_package_states_its_responsibility_and_curates_its_names():
    for init in sorted(JZERO.glob("*/__init__.py")):
        tree = ast.parse(init.read_text())
        doc = ast.get_docstring(tree)
        assert doc and doc.splitlines()[0].endswith("."), f"{init}: a one-sentence docstring"
        names = [
            t.id
            for node in tree.body
            if isinstance(node, ast.Assign)
            for t in node.targets
            if isinstance(t, ast.Name)
        ]
        assert "__all__" in names, f"{init} curates no public names (__all__)"


DEPRECATIONS = {"DeprecationWarning", "PendingDeprecationWarning"}
ALIAS_HELPERS = ("moved", "renamed_module")  # what kept a former name importable, in _util


def _called(node: ast.AST) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _warns_deprecation(call: ast.Call) -> bool:
    category = call.args[1] if len(call.args) > 1 else None
    category = next((k.value for k in call.keywords if k.arg == "category"), category)
    return _called(call.func) == "warn" and _called(category) in DEPRECATIONS


def _only_reexports(path: Path, tree: ast.Module, root: Path) -> bool:
    """Whether the module does nothing but import another module's names and list them (and
    warn): a module of imports, ``__all__`` and ``warn`` calls, or a package's ``__init__``
    of those that imports none of its own modules."""
    name = _module_name(path, root)
    init = path.name == "__init__.py"
    here = name if init else name.rsplit(".", 1)[0]
    sources = []
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            if _called(node.value.func) != "warn":
                return False
        elif isinstance(node, ast.Import):
            sources += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
            sources.append(".".join(base + ([node.module] if node.module else [])))
        elif not (
            isinstance(node, ast.Assign)
            and all(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
        ):
            return False
    ours = [s for s in sources if s.split(".")[0] == root.name]
    return bool(ours) and not (init and any(_under(s, (name,)) for s in ours))


def alias_modules(root: Path) -> list[str]:
    """``file:line what`` for each trace of a former name kept importable: a module whose
    docstring calls it a deprecated alias, a module that only re-exports another module's
    names, a ``warn`` with a ``DeprecationWarning``, and the helpers that made such aliases
    (``moved``, ``renamed_module`` in ``_util.py``). The CHANGELOG records the renames; the
    tree holds only the names there are. (The config's ``JzeroConfigDeprecationWarning``, for
    DeepSpeed's own deprecated keys in a user's file, is a ``FutureWarning`` and no alias.)"""
    found = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root.parent)
        tree = ast.parse(path.read_text(), str(path))
        if (ast.get_docstring(tree) or "").lower().startswith("deprecated alias"):
            found.append(f"{where}:1 is a deprecated alias")
        if _only_reexports(path, tree, root):
            found.append(f"{where}:1 only re-exports another module's names")
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _warns_deprecation(node):
                found.append(f"{where}:{node.lineno} warns a DeprecationWarning")
            if isinstance(node, ast.FunctionDef) and path == root / "_util.py":
                if node.name in ALIAS_HELPERS:
                    found.append(f"{where}:{node.lineno} defines {node.name}")
    return found


def test_no_alias_module_and_no_deprecated_name_is_kept():
    assert alias_modules(JZERO) == []


def test_the_alias_check_finds_an_alias_planted_in_a_copy(tmp_path):
    import shutil

    pkg = tmp_path / "jzero"
    shutil.copytree(JZERO, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / "data.py").write_text(
        '"""Deprecated alias of :mod:`jzero.demo.data`."""\n\nimport warnings\n\n'
        "from jzero.demo.data import BatchIterator as BatchIterator\n\n"
        '__all__ = ["BatchIterator"]\n\n'
        'warnings.warn("jzero.data is deprecated", DeprecationWarning, stacklevel=2)\n'
    )
    (pkg / "models").mkdir()
    (pkg / "models" / "__init__.py").write_text(
        '"""The built-in GPT."""\n\nfrom ..demo.gpt import GPT as GPT\n\n__all__ = ["GPT"]\n'
    )
    (pkg / "choices" / "former.py").write_text(
        '"""Names."""\n\nNEW = 1\n\n\ndef __getattr__(name):\n    import warnings\n\n'
        '    warnings.warn(f"{name} moved", category=DeprecationWarning)\n    return NEW\n'
    )
    util = (pkg / "_util.py").read_text() + "\n\ndef renamed_module(old, new):\n    pass\n"
    (pkg / "_util.py").write_text(util)
    assert alias_modules(pkg) == [
        f"jzero/_util.py:{util.count(chr(10)) - 1} defines renamed_module",
        "jzero/choices/former.py:9 warns a DeprecationWarning",
        "jzero/data.py:1 is a deprecated alias",
        "jzero/data.py:1 only re-exports another module's names",
        "jzero/data.py:9 warns a DeprecationWarning",
        "jzero/models/__init__.py:1 only re-exports another module's names",
    ]


def _file_and_name(found: str) -> str:
    """``file name`` of a ``file:line name ...`` finding (the line moves with every edit)."""
    where, name = found.split(" ")[:2]
    return f"{where.split(':')[0]} {name}"


def test_no_module_imports_a_private_name_of_a_sibling_module():
    found = private_imports(JZERO, siblings=True)
    assert found == []


def test_the_sibling_check_finds_a_private_name_imported_within_its_package(tmp_path):
    pkg = planted(tmp_path, ("a", "b"), init='"""A package."""\n')
    (pkg / "a" / "_helpers.py").write_text("def shown():\n    pass\n")
    (pkg / "a" / "x.py").write_text("def _hidden():\n    pass\n\n\ndef shown():\n    pass\n")
    (pkg / "a" / "y.py").write_text(
        "from jzero.a import _helpers\nfrom jzero.a._helpers import shown\n"
        "from jzero.a.x import _hidden\nfrom .x import _hidden as h\nimport jzero.a.x as _x\n"
    )
    (pkg / "b" / "z.py").write_text(
        "from jzero.a.x import shown\n\n\ndef f():\n    from jzero.a.x import _hidden\n"
    )
    assert private_imports(pkg, siblings=True) == [
        "jzero/a/y.py:3 _hidden from jzero.a.x",
        "jzero/a/y.py:4 _hidden from jzero.a.x",
        "jzero/b/z.py:5 _hidden from jzero.a.x",
    ]


def _circles(root: Path, node: Callable[[str], str]) -> list[str]:
    """``a <-> b <-> ...`` (sorted) for each set of ``node``s (of ``root``'s modules) that reach
    each other round a circle through imports that run (:func:`jzero_imports` with ``run``, at
    import or inside a function; an import under ``if TYPE_CHECKING:`` never runs)."""
    graph: dict[str, set[str]] = {}
    for where, target in jzero_imports(root, run=True, typing=False):
        source = node(_module_name(root.parent / where.split(":")[0], root))
        if node(target) != source:
            graph.setdefault(source, set()).add(node(target))

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reached = {m: reach(m) for m in graph}
    circles = {tuple(sorted(m2 for m2 in reached[m] if m in reached.get(m2, ()))) for m in reached}
    return sorted(" <-> ".join(c) for c in circles if c)


def import_cycles(root: Path) -> list[str]:
    """The circles between ``root``'s modules (:func:`_circles`; a package's ``__init__``
    counts as its own module, and importing ``a.b`` is not counted as running ``a``)."""
    return _circles(root, lambda module: module)


def test_no_import_cycle_between_jzero_modules():
    assert import_cycles(JZERO) == []


def package_loops(root: Path) -> list[str]:
    """The circles between ``root``'s top-level packages (:func:`_circles`; ``jzero.a`` stands
    for every module under ``jzero/a/``)."""
    return _circles(root, lambda module: ".".join(module.split(".")[:2]))


def test_no_import_loop_between_jzero_packages():
    # The layers: choices and costs under the plan, the parallelisms' leaf rules under the plan
    # and their step parts over it (the plan reaches them only as a type).
    assert package_loops(JZERO) == []


def test_the_package_loop_check_counts_imports_that_run(tmp_path):
    pkg = planted(tmp_path, ("a", "b", "c"))
    (pkg / "a" / "x.py").write_text("from jzero.b.y import f\n")
    (pkg / "b" / "y.py").write_text("def f():\n    from jzero.a import z\n")  # runs: a loop
    (pkg / "a" / "z.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from jzero.c import w\n"
    )
    (pkg / "c" / "w.py").write_text("import jzero.a.x\n")  # a <- c only as a type: no loop
    assert package_loops(pkg) == ["jzero.a <-> jzero.b"]


def test_the_cycle_check_finds_a_circle_closed_inside_a_function_or_by_name(tmp_path):
    pkg = planted(tmp_path, ("a", "b", "c"), init='"""The package."""\n\nfrom jzero import a\n')
    (pkg / "a" / "x.py").write_text("from jzero.b import y\n")
    (pkg / "b" / "y.py").write_text(
        "import importlib\n\n\ndef f():\n    return importlib.import_module('jzero.a.x')\n"
    )
    (pkg / "b" / "w.py").write_text("def g():\n    from ..c import v\n")
    (pkg / "c" / "v.py").write_text("from jzero.b.w import g\nfrom jzero import a\n")
    (pkg / "c" / "u.py").write_text("from jzero.a import x\n")  # leads to a circle, is in none
    assert import_cycles(pkg) == [
        "jzero.a.x <-> jzero.b.y",
        "jzero.b.w <-> jzero.c.v",
    ]


# jzero.engine's initialize is being restructured (issue 58, item 1); empty this set then.
LONG_SIGNATURES_ALLOWED: set[str] = set()


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Positional, keyword and keyword-only parameters; ``self``/``cls`` not counted, nor
    ``*args``/``**kwargs``."""
    args = fn.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    return len(names) - (1 if names[:1] in (["self"], ["cls"]) else 0)


def long_signatures(root: Path, limit: int = 8) -> list[str]:
    """``file:line name count`` for each public function of ``root``'s modules that takes
    more than ``limit`` parameters: a module's functions without a leading underscore, and the
    methods (``__init__`` included) of its classes without one. What travels together is
    grouped into a value (``GatherOptions``, ``MuonOptions``) instead."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                members = [(f"{node.name}.", m) for m in node.body if isinstance(m, functions)]
                members = [(p, m) for p, m in members if m.name in ("__init__", "__call__")
                           or not m.name.startswith("_")]  # fmt: skip
            elif isinstance(node, functions) and not node.name.startswith("_"):
                members = [("", node)]
            else:
                continue
            for prefix, fn in members:
                if (count := _parameters(fn)) > limit:
                    where = f"{path.relative_to(root.parent)}:{fn.lineno}"
                    found.append(f"{where} {prefix}{fn.name} {count}")
    return found


def test_no_public_function_takes_more_than_eight_parameters():
    found = long_signatures(JZERO)
    assert [f for f in found if _file_and_name(f) not in LONG_SIGNATURES_ALLOWED] == []


def test_the_signature_check_finds_a_planted_nine_parameter_function(tmp_path):
    pkg = tmp_path / "jzero"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""The package."""\n')
    nine = "a, b, c, d, e=0, *args, f=0, g=0, h=0, i=0, **kw"
    eight = "a, b, c, d, e=0, *, f=0, g=0, h=0"
    (pkg / "m.py").write_text(
        f"def wide({nine}):\n    pass\n\n\ndef fits({eight}):\n    pass\n\n\n"
        f"def _private({nine}):\n    pass\n\n\n"
        f"class Value:\n    def __init__(self, {nine}):\n        pass\n\n"
        f"    @classmethod\n    def make(cls, {eight}):\n        pass\n\n"
        f"    def _helper(self, {nine}):\n        pass\n\n\n"
        f"class _Private:\n    def __init__(self, {nine}):\n        pass\n"
    )
    (pkg / "_private_module.py").write_text(
        f"def public({nine}):\n    def inner({nine}):\n        pass\n"
    )
    assert long_signatures(pkg) == [
        "jzero/_private_module.py:1 public 9",
        "jzero/m.py:1 wide 9",
        "jzero/m.py:14 Value.__init__ 9",
    ]


ABOVE_COSTS = (
    "jzero.engine", "jzero.demo", "jzero.memory", "jzero.config", "jzero.cli", "jzero.plan",
    "jzero.parallel",
)  # fmt: skip


def costs_imports_above(root: Path) -> list[str]:
    """The imports that lift the cost model above what reads it: ``jzero.costs`` (the pure
    formulas the estimate, the auto layout and the plan's layout all call) importing the engine,
    the demo, the memory planner, the config, the CLI, the plan or the parallelisms."""
    return _imports_into(root, "jzero.costs", ABOVE_COSTS)


def test_the_cost_model_imports_nothing_that_reads_it():
    assert costs_imports_above(JZERO) == []


def test_the_cost_model_check_finds_an_import_from_above(tmp_path):
    pkg = tmp_path / "jzero"
    planted = {
        "costs/a.py": "from jzero.choices import x\n\n\ndef f():\n    from jzero.engine import x\n",
        "costs/b.py": "import jzero.memory._estimate\nfrom ..config import x\n",
        "memory/c.py": "from jzero.costs import predict\n",  # read from above: allowed
    }
    for path, text in planted.items():
        (pkg / path).parent.mkdir(parents=True, exist_ok=True)
        (pkg / path).write_text(text)
    assert costs_imports_above(pkg) == [
        "jzero/costs/a.py:5 jzero.engine",
        "jzero/costs/b.py:1 jzero.memory._estimate",
        "jzero/costs/b.py:2 jzero.config",
    ]


def _lazy_table(tree: ast.Module) -> dict[str, str] | None:
    """The ``{name: "module.attribute"}`` table of a ``lazy_exports(__name__, {...})`` call at
    the module's top level, or None without one."""
    for node in tree.body:
        call = node.value if isinstance(node, ast.Assign) else None
        if isinstance(call, ast.Call) and _called(call.func) == "lazy_exports":
            table = call.args[1]
            return {k.value: v.value for k, v in zip(table.keys, table.values, strict=True)}
    return None


def _type_checking_imports(tree: ast.Module, here: str) -> dict[str, str]:
    """``{name: "module.attribute"}`` of the ``from ... import ...`` under the module's
    ``if TYPE_CHECKING:`` (``here``: the package a relative import starts from)."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.If) and _called(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                if not isinstance(imp, ast.ImportFrom):
                    continue
                base = here.split(".")[: len(here.split(".")) - imp.level + 1] if imp.level else []
                source = ".".join(base + ([imp.module] if imp.module else []))
                found.update({a.asname or a.name: f"{source}.{a.name}" for a in imp.names})
    return found


def _defined(tree: ast.Module) -> set[str]:
    """The names the module's top level binds: assignments, functions, classes, imports."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for t in node.targets:
                elts = t.elts if isinstance(t, ast.Tuple) else [t]
                names |= {e.id for e in elts if isinstance(e, ast.Name)}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _names_all(node: ast.Assign) -> bool:
    return any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)


def lazy_table_problems(root: Path) -> list[str]:
    """``file name: problem`` for each package whose names load on first use
    (:func:`jzero._util.lazy_exports`) where the table disagrees with the imports under its
    ``if TYPE_CHECKING:`` (which type checkers and this file's other rules read), or a name of
    its ``__all__`` is neither in the table nor bound by the module. (The table may hold a
    name ``__all__`` leaves out: the module's own constants a sibling package reads.)"""
    found = []
    for path in sorted(root.rglob("__init__.py")):
        tree = ast.parse(path.read_text(), str(path))
        table = _lazy_table(tree)
        if table is None:
            continue
        where = path.relative_to(root.parent)
        typed = _type_checking_imports(tree, _module_name(path, root))
        for name in sorted(set(table) | set(typed)):
            if table.get(name) != typed.get(name):
                found.append(f"{where} {name}: table {table.get(name)}, import {typed.get(name)}")
        lists = [n for n in tree.body if isinstance(n, ast.Assign) and _names_all(n)]
        public = [e.value for n in lists for e in n.value.elts]
        for name in sorted(set(public) - set(table) - _defined(tree)):
            found.append(f"{where} {name}: in __all__, never bound")
    return found


def test_each_lazy_table_agrees_with_its_type_checking_imports_and_all():
    assert lazy_table_problems(JZERO) == []


def test_the_lazy_table_check_finds_a_name_out_of_step(tmp_path):
    pkg = tmp_path / "jzero"
    (pkg / "a").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""The package."""\n')
    (pkg / "a" / "__init__.py").write_text(
        '"""A package."""\n\nfrom typing import TYPE_CHECKING\n\n'
        "from jzero._util import lazy_exports\n\nif TYPE_CHECKING:\n"
        "    from jzero.a.x import f as f\n    from .x import g as g\n    from .y import h as h\n"
        "    from jzero.a.y import k as k\n\n"
        '__all__ = ["f", "g", "h", "VERSION", "missing"]\n\nVERSION = 1\n\n'
        "__getattr__, __dir__ = lazy_exports(\n    __name__,\n"
        '    {"f": "jzero.a.x.f", "g": "jzero.a.x.g", "h": "jzero.a.x.h", "k": "jzero.a.y.k",\n'
        '     "m": "jzero.a.y.m"},\n)\n'
    )
    assert lazy_table_problems(pkg) == [
        "jzero/a/__init__.py h: table jzero.a.x.h, import jzero.a.y.h",
        "jzero/a/__init__.py m: table jzero.a.y.m, import None",
        "jzero/a/__init__.py missing: in __all__, never bound",
    ]
