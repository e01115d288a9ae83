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


# the floors, bottom up: the loss library and the config tree (each imports only itself); how a model
# runs a row (the forward: the loss library at most); the shared ground (batches, transports,
# user-code loading, data); what a model is; rewards and the learner (beside each other, never
# importing one another); episodes; generation; the run; the command line
FLOORS = {"config": 0, "loss": 0, "forward": 1, "ground": 2, "models": 3, "rewards": 4, "learner": 4,
          "episodes": 5, "rollout": 6, "run": 7, "serve": 8, "top": 9}  # fmt: skip
GROUND = {"rltrain", "rltrain.moved", "rltrain.batch", "rltrain.plan", "rltrain.remote", "rltrain.weight_transfer", "rltrain.loading",
          "rltrain.data", "rltrain.media", "rltrain.sandbox", "rltrain.tasks", "rltrain.prompt_sampler", "rltrain.curves"}  # fmt: skip
PUBLIC = {"rltrain.masked_mean": "loss", "rltrain.losses": "loss", "rltrain.envs": "episodes"}


def layer(module: str) -> str:
    """The folder a module is in, ``ground`` for the shared modules at the top of the package, the
    public paths as the layer they name, ``top`` for the command line."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in FLOORS:
        return parts[1]
    return "ground" if module in GROUND else PUBLIC.get(module, "top")


def test_the_layers_point_down():
    # every import goes to the module's own folder or to a lower floor: rewards and the learner never
    # meet, and the rollout side and the learner meet only in the driver (run/), which knows both
    graph = imports()
    wrong = [f"{module} -> {dep}" for module, deps in graph.items() for dep in deps
             if layer(dep) != layer(module) and FLOORS[layer(dep)] >= FLOORS[layer(module)]
             and not layer(dep) == layer(module) == "ground"]  # fmt: skip
    assert not wrong, wrong
    assert {layer(m) for m in graph} == set(FLOORS)  # every floor has its modules, and nothing else


def test_the_public_paths_of_the_loss_library_are_its_modules():
    import importlib

    from rltrain.masked_mean import group_token_totals, masked_mean  # noqa: F401  (the README's paths)

    for public_name, real_name in [
        ("masked_mean", "loss.masked_mean"),
        ("losses", "loss.losses"),
        ("envs", "episodes.environments"),
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


def code_lines(path: Path) -> int:
    """Lines that are neither blank, comments nor docstrings."""
    tree = ast.parse(path.read_text())
    docs = {
        line
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant)
        and isinstance(node.value.value, str)
        for line in range(node.lineno, node.end_lineno + 1)
    }  # fmt: skip
    return sum(
        1
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if line.strip() and not line.strip().startswith("#") and i not in docs
    )


def test_the_rooms_hold_what_their_names_say_and_stay_small():
    # each stage a folder of at most ~3,000 lines, no module past ~450, an __init__ that exports
    modules = {path: len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert not [f"{p.relative_to(PACKAGE)}: {n}" for p, n in modules.items() if n > 450]
    assert not [f"{p.relative_to(PACKAGE)}: {code_lines(p)}" for p in modules
                if p.name == "__init__.py" and code_lines(p) > 60]  # fmt: skip
    folders = {}
    for path, n in modules.items():
        if path.parent != PACKAGE:
            folders[path.parent.name] = folders.get(path.parent.name, 0) + n
    assert set(folders) == set(FLOORS) - {"ground", "top"}
    assert not {name: n for name, n in folders.items() if n > 3000}, folders
    names = [path.stem for path in modules]
    assert "checks" not in {p.stem for p in (PACKAGE / "run").glob("*.py")}  # the run's is its preflight
    assert names.count("routers") + names.count("routes") <= 1  # one module of that name: the routers


def test_moved_modules_import_under_their_old_names_for_one_release_with_a_warning():
    import importlib
    import sys
    import warnings

    from rltrain import MOVED

    for old, new in MOVED.items():
        assert not (PACKAGE.parent / (old.replace(".", "/") + ".py")).exists(), old  # gone as a file
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught), old
        real = importlib.import_module(new)
        public = [name for name in vars(real) if not name.startswith("_")]
        assert all(getattr(module, name) is getattr(real, name) for name in public), old
    # names moved out of a module that stays: forwarded by the same table (the module itself needs no
    # import of their new home: rltrain.loss.logprobs stays below the forward, test_the_layers_point_down)
    from rltrain import MOVED_NAMES

    for old, (home, names) in MOVED_NAMES.items():
        module = importlib.import_module(old)
        for name in names:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                forwarded = getattr(module, name)
            assert forwarded is getattr(importlib.import_module(home), name)
            assert any(f"{old}.{name} is now {home}.{name}" in str(w.message) for w in caught)


def test_the_loss_library_imports_without_the_trainers_stack():
    # rltrain.loss is pure math (torch, and torch.distributed for the step's token totals): importing
    # every module of it, and the public paths, with transformers, ray, deepspeed, vllm and peft made
    # unimportable; and no module of it imports another part of rltrain
    import subprocess
    import sys

    modules = sorted(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
                     for p in (PACKAGE / "loss").glob("*.py"))  # fmt: skip
    blocked = """
import importlib.abc, sys
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"transformers", "ray", "deepspeed", "vllm", "peft", "pydantic"}:
            raise ImportError(f"{name} is not to be imported by the loss library")
sys.meta_path.insert(0, Blocked())
"""
    code = blocked + f"import {', '.join([*modules, 'rltrain.masked_mean', 'rltrain.losses'])}; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    graph = imports()
    assert not {
        m: deps for m, deps in graph.items() if layer(m) == "loss" and {layer(d) for d in deps} - {"loss"}
    }


def test_names_that_left_a_module_that_stays_import_from_it_for_one_release_with_a_warning():
    import importlib
    import warnings

    from rltrain import forward
    from rltrain.forward import tree

    for old, names, new in [("rltrain.loss.logprobs", ("sequence_logprobs", "packed_forward", "token_outputs"), forward),
                            ("rltrain.learner.prefix_tree", ("tree_logprobs", "tree_outputs", "first_index"), tree)]:  # fmt: skip
        module = importlib.import_module(old)
        for name in names:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                assert getattr(module, name) is getattr(new, name)
            assert any(
                issubclass(w.category, DeprecationWarning) and new.__name__ in str(w.message) for w in caught
            )
