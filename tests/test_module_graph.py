"""The package's import graph: no module imports another that imports it back, lazily or not."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rltrain"


def imports() -> dict[str, set[str]]:
    """Each rltrain module and the rltrain modules it imports anywhere (inside functions too)."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in files.items():
        found = set()
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if _type_checking(block) for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in typing_only:  # `if TYPE_CHECKING:` imports never run
                continue
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rltrain"):
                # `from rltrain import checkpoint` names a module, `from rltrain.x import f` a name in x
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                          for a in node.names}  # fmt: skip
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.startswith("rltrain")}
        graph[name] = found - {name}
    return graph


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def test_no_module_imports_one_that_imports_it_back():
    graph = imports()
    assert {"rltrain.train", "rltrain.eval", "rltrain.launch"} <= graph.keys()
    cycles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        for dep in sorted(graph.get(module, ())):
            if dep in path:
                cycles.append(path[path.index(dep) :] + [dep])
            elif dep not in done:
                visit(dep, [*path, dep])
        done.add(module)

    for module in sorted(graph):
        visit(module, [module])
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles)


def test_the_old_paths_of_the_rollout_modules_are_the_moved_modules():
    import importlib

    for name in ("tools", "rewards", "sandbox"):
        old, moved = (
            importlib.import_module(f"rltrain.{name}"),
            importlib.import_module(f"rltrain.rollout.{name}"),
        )
        assert old is moved, name  # one module under two names: no copy, no second state
    from rltrain.tools import calculator  # the README's example environment imported it this way

    assert calculator("2 + 3") == "5"
