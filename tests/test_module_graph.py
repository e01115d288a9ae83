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
    assert {"rltrain.train", "rltrain.run.eval", "rltrain.run.launch"} <= graph.keys()
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


def layer(module: str) -> str:
    """``loss``, ``rollout``, ``learner``, ``run``, or the module itself for the shared ones at the top."""
    parts = module.split(".")
    return (
        parts[1] if len(parts) > 1 and parts[1] in ("config", "loss", "rollout", "learner", "run") else module
    )


def test_the_layers_point_down():
    # loss/ is pure; config sits below everything; rollout/ and learner/ never meet except through
    # the driver (run/), which alone knows both
    graph = imports()
    allowed = {
        "loss": {"loss"},
        "rollout": {
            "rollout",
            "loss",
            "config",
            "rltrain.batch",
            "rltrain.remote",
            "rltrain.data",
            "rltrain.loading",
            "rltrain.adapters",
            "rltrain.weight_transfer",
            "rltrain.tasks",
            "rltrain.routing",
        },
        "learner": {
            "learner",
            "loss",
            "config",
            "rltrain.batch",
            "rltrain.remote",
            "rltrain.adapters",
            "rltrain.weight_transfer",
            "rltrain.routing",
        },  # fmt: skip
        "rltrain.loading": set(),  # the user's code, loaded for rewards, environments and agents
        "config": {"config"},
    }
    wrong = [f"{module} -> {dep}" for module, deps in graph.items() if layer(module) in allowed
             for dep in deps if layer(dep) not in allowed[layer(module)] | {layer(module)}]  # fmt: skip
    assert not wrong, wrong


def test_the_public_paths_of_the_loss_library_are_its_modules():
    import importlib

    from rltrain.masked_mean import group_token_totals, masked_mean  # noqa: F401  (the README's paths)

    for public_name, real_name in [
        ("masked_mean", "loss.masked_mean"),
        ("losses", "loss.losses"),
        ("envs", "rollout.environments"),
    ]:  # (the environments' protocol too)
        public, real = (
            importlib.import_module(f"rltrain.{public_name}"),
            importlib.import_module(f"rltrain.{real_name}"),
        )
        assert public is real, public_name  # one module under two names: no copy, no second state


def test_no_class_over_250_lines_and_no_function_over_80():
    sizes = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                limit = 250 if isinstance(node, ast.ClassDef) else 80
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    sizes.append(f"{path.relative_to(PACKAGE.parent)}:{node.name} {length} lines")
    assert not sizes, sizes
