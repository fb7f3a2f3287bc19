"""The shape of the house, read from a source tree with ``ast``: what a newcomer meets.

Run: ``python benchmarks/house.py [ROOT]`` (default: this checkout; any checkout of jzero, e.g. an
older commit's ``git archive``, to compare). Prints:

* modules, packages, lines, and the import edges between jzero's modules (imports inside
  functions counted, those under ``if TYPE_CHECKING:`` not: they never run); import cycles
  between modules, and loops between packages;
* the largest files and functions (lines);
* public functions and methods over 8 parameters (``self``/``cls``, ``*args``, ``**kwargs`` not
  counted);
* ``Plan``'s dataclass fields and methods, and ``Engine``'s attributes set outside ``__init__``
  (what the engine re-decides after it is built);
* private names imported from another module of the same package or another package.

Repeated blocks are the ``duplicates`` tool's (run it on ``jzero/``); state bytes are
``benchmarks/state_at_initialize.py``'s.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted((root / "jzero").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _package(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rsplit(".", 1)[0] if "." in name else ""
    return name or None


def _type_only(tree: ast.Module) -> set[int]:
    """The ``id`` of each node under a top-level ``if TYPE_CHECKING:`` (never run)."""
    return {
        id(node)
        for block in tree.body
        if isinstance(block, ast.If) and getattr(block.test, "id", "") == "TYPE_CHECKING"
        for stmt in block.body
        for node in ast.walk(stmt)
    }


def imports(mods: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """Edges module -> module through imports that run (at import or inside a function; not
    those under ``if TYPE_CHECKING:``), and each private name imported from another module."""
    edges: dict[str, set[str]] = defaultdict(set)
    private = []
    for name, path in mods.items():
        here = _package(name, path)
        tree = ast.parse(path.read_text())
        skip = _type_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
                source = _resolve(base, mods)
                if source and source != name:
                    for a in node.names:
                        if a.name.startswith("_") and not a.name.startswith("__"):
                            private.append(f"{name} {a.name}")
            for t in targets:
                found = _resolve(t, mods) if t.startswith("jzero") else None
                if found and found != name and not (name.startswith(found + ".")):
                    edges[name].add(found)
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    return len([n for n in names if n not in ("self", "cls")])


def functions(mods: dict[str, Path], root: Path):
    """``(lines, params, public, where)`` of every function and method."""
    out = []
    for path in mods.values():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for f in node.body:
                    if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        f.parent_class = node.name  # type: ignore[attr-defined]
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                owner = getattr(node, "parent_class", None)
                public = (not node.name.startswith("_") or node.name == "__init__") and not (
                    owner or "x"
                ).startswith("_")
                name = f"{owner}.{node.name}" if owner else node.name
                lines = node.end_lineno - node.lineno + 1
                where = f"{path.relative_to(root)}:{name}"
                out.append((lines, _params(node), public, where))
    return out


def class_facts(mods: dict[str, Path], cls: str) -> tuple[int, int, set[str]]:
    """Fields (annotated class attributes), methods and properties of class ``cls``, and the
    ``self.x`` attributes its methods other than ``__init__`` assign."""
    for path in mods.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == cls:
                fields = [n for n in node.body if isinstance(n, ast.AnnAssign)]
                methods = [
                    n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                ]
                later = set()
                for m in methods:
                    if m.name == "__init__":
                        continue
                    for sub in ast.walk(m):
                        targets = []
                        if isinstance(sub, ast.Assign):
                            targets = sub.targets
                        elif isinstance(sub, (ast.AugAssign, ast.AnnAssign)):
                            targets = [sub.target]
                        for t in targets:
                            for e in ast.walk(t):
                                if (
                                    isinstance(e, ast.Attribute)
                                    and isinstance(e.value, ast.Name)
                                    and e.value.id == "self"
                                ):
                                    later.add(e.attr)
                return len(fields), len(methods), later
    return 0, 0, set()


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    mods = modules(root)
    edges, private = imports(mods)
    lines = {n: len(p.read_text().splitlines()) for n, p in mods.items()}
    packages = {n for n, p in mods.items() if p.name == "__init__.py"}
    print(f"house of {root}")
    print(
        f"  {len(mods)} modules in {len(packages)} packages, {sum(lines.values()):,} lines, "
        f"{sum(len(v) for v in edges.values())} import edges between modules"
    )
    found = cycles(edges)
    print(f"  import cycles: {len(found)}" + "".join(f"\n    {' <-> '.join(c)}" for c in found))
    top = defaultdict(set)  # jzero.a stands for every module under jzero/a/
    for a, targets in edges.items():
        for b in targets:
            pa, pb = (".".join(m.split(".")[:2]) for m in (a, b))
            if pa != pb:
                top[pa].add(pb)
    loops = cycles(top)
    print(
        f"  loops between packages: {len(loops)}"
        + "".join(f"\n    {' <-> '.join(c)}" for c in loops)
    )
    print("  largest files:")
    for n in sorted(lines, key=lines.get, reverse=True)[:5]:
        print(f"    {lines[n]:>5}  {mods[n].relative_to(root)}")
    funcs = functions(mods, root)
    print("  largest functions:")
    for f in sorted(funcs, reverse=True)[:5]:
        print(f"    {f[0]:>5}  {f[3]}")
    wide = sorted((f for f in funcs if f[2] and f[1] > 8), key=lambda f: -f[1])
    print(f"  public functions over 8 parameters: {len(wide)}")
    for f in wide:
        print(f"    {f[1]:>5}  {f[3]}")
    fields, methods, _ = class_facts(mods, "Plan")
    print(f"  Plan: {fields} fields, {methods} methods and properties")
    _, _, later = class_facts(mods, "Engine")
    print(f"  Engine: {len(later)} attributes set outside __init__: {', '.join(sorted(later))}")
    print(f"  private names imported from another module: {len(private)}")


if __name__ == "__main__":
    main()
