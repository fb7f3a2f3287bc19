"""The house rules, read from the source with ``ast``: no module imports a private name from
another package, every package's ``__init__`` states its responsibility and curates its names, and
the config is read once: the core imports nothing of the config (nor the engine, which translates
it), and the config nothing of the core; the memory estimator imports neither the engine nor
the demo's model.

A private name (``_x``) may be imported within its own package (``jzero.nvme.store`` from
``jzero.nvme.file_format``), never from another one: a name another package needs is public API
of its package. Imports inside functions count too.
"""

import ast
from pathlib import Path

from repo import ROOT

JZERO = ROOT / "jzero"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def private_imports(root: Path) -> list[str]:
    """``file:line name from module`` for each private name a module imports from a module of
    another package (the package of ``jzero.a.b`` is ``jzero.a``; of ``jzero.a`` (a module
    directly under ``jzero/``) ``jzero``; a package's ``__init__`` is in its own package)."""
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
            if source_package == here:
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(
                        f"{path.relative_to(root.parent)}:{node.lineno} {alias.name} from {source}"
                    )
    return found


def jzero_imports(root: Path) -> list[tuple[str, str]]:
    """``(file:line, module)`` for each module of ``root``'s package that a module imports
    (``from a.b import c`` names ``a.b``; a relative import is resolved), anywhere in it."""
    found = []
    for path in sorted(root.rglob("*.py")):
        name = _module_name(path, root)
        here = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                sources = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    sources = [".".join(base + ([node.module] if node.module else []))]
                else:
                    sources = [node.module or ""]
            else:
                continue
            where = f"{path.relative_to(root.parent)}:{node.lineno}"
            found += [(where, s) for s in sources if s.split(".")[0] == root.name]
    return found


def _under(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


CORE = ("jzero.plan", "jzero.replay", "jzero.step", "jzero.comm", "jzero.subgroups")


def forbidden_imports(root: Path) -> list[str]:
    """The imports that cross the config's wall: the core (plan, replay, step, comm, groups)
    importing the config or the engine (whose ``settings`` translates it), and the config or
    the choices it validates against importing anything of jzero's but themselves and
    ``jzero._util``. Deprecated names reach their new home through ``jzero._util.moved``, by
    name, so they add no import."""
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


ABOVE_MEMORY = ("jzero.engine", "jzero.demo", "jzero.models", "jzero.train", "jzero.data")


def memory_imports_above(root: Path) -> list[str]:
    """The imports that lift the memory estimator above what it measures: ``jzero.memory``
    importing the engine or the demo's model, data or loop (or their deprecated aliases).
    Its measured report takes an engine, and :func:`jzero.memory.measure_stages` a model, from
    the caller; ``plan_report`` (the built-in GPT's) is reached by name, adding no import."""
    name = root.name
    memory = f"{name}.memory"
    above = tuple(p.replace("jzero", name, 1) for p in ABOVE_MEMORY)
    found = []
    for where, source in jzero_imports(root):
        module = _module_name(root.parent / where.split(":")[0], root)
        if _under(module, (memory,)) and _under(source, above):
            found.append(f"{where} {source}")
    return found


def test_the_memory_estimator_imports_no_engine_and_no_model():
    assert memory_imports_above(JZERO) == []


def test_the_memory_check_finds_an_engine_or_a_model_imported(tmp_path):
    pkg = tmp_path / "jzero"
    for sub in ("memory", "engine", "demo", "plan"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text('"""A package."""\n')
    (pkg / "__init__.py").write_text('"""The package."""\n')
    (pkg / "memory" / "a.py").write_text(
        "from jzero.plan import make_plan\n\n\ndef f():\n    from jzero.engine import initialize\n"
    )
    (pkg / "memory" / "b.py").write_text("import jzero.models.gpt\nfrom ..demo import gpt\n")
    (pkg / "engine" / "c.py").write_text("from jzero.memory import estimate\n")
    assert memory_imports_above(pkg) == [
        "jzero/memory/a.py:5 jzero.engine",
        "jzero/memory/b.py:1 jzero.models.gpt",
        "jzero/memory/b.py:2 jzero.demo",
    ]


def test_the_core_and_the_config_import_nothing_of_each_other():
    assert forbidden_imports(JZERO) == []


def test_the_import_check_finds_the_core_reading_the_config_and_back(tmp_path):
    pkg = tmp_path / "jzero"
    for sub in ("config", "plan", "step", "choices", "distributed", "engine"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text('"""A package."""\n')
    (pkg / "__init__.py").write_text('"""The package."""\n')
    (pkg / "plan" / "a.py").write_text("from jzero.choices import stages\nimport jzero.config\n")
    (pkg / "step" / "b.py").write_text("def f():\n    from ..engine import settings\n")
    (pkg / "config" / "c.py").write_text(
        "from jzero._util import moved\nfrom jzero.choices import stages\n"
        "from jzero.distributed import pipeline\n"
    )
    (pkg / "choices" / "d.py").write_text("from jzero.plan import a\n")
    assert forbidden_imports(pkg) == [
        "jzero/choices/d.py:1 jzero.plan",
        "jzero/config/c.py:3 jzero.distributed",
        "jzero/plan/a.py:2 jzero.config",
        "jzero/step/b.py:2 jzero.engine",
    ]


def test_no_private_name_is_imported_from_another_package():
    assert private_imports(JZERO) == []


def test_the_check_finds_a_private_import_from_another_package(tmp_path):
    pkg = tmp_path / "jzero"
    (pkg / "a").mkdir(parents=True)
    (pkg / "b").mkdir()
    for init in (pkg, pkg / "a", pkg / "b"):
        (init / "__init__.py").write_text('"""A package."""\n')
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
