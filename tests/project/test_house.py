"""The house rules, read from the source with ``ast``: no module imports a private name from
another package, and every package's ``__init__`` states its responsibility and curates its names.

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
