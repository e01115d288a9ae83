"""Loading what a user names in the config: ``module:name`` or ``path/to/file.py:name`` (reward
functions, environments, agents), with one line saying what went wrong."""

from __future__ import annotations

import importlib


def import_attribute(spec: str, not_a_spec: str):
    """``module:name`` or ``path/to/file.py:name`` imported; raises ValueError saying what went
    wrong (``not_a_spec`` when ``spec`` has neither shape)."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r} is {not_a_spec}")
    try:
        module = (
            _import_file(module_name) if module_name.endswith(".py") else importlib.import_module(module_name)
        )
        return getattr(module, attr)
    except ModuleNotFoundError as e:
        raise ValueError(
            f"cannot load {spec!r}: {e}; the module must be importable from where rltrain runs (start "
            f"it in the folder that holds {module_name.split('.')[0]}.py, or add that folder to PYTHONPATH), "
            f"or name its file: path/to/{module_name.split('.')[-1]}.py:{attr}"
        ) from None
    except (ImportError, AttributeError, FileNotFoundError) as e:
        raise ValueError(f"cannot load {spec!r}: {e}") from None
    except Exception as e:  # the user's module raised while it was imported
        raise ValueError(
            f"cannot load {spec!r}: importing {module_name} raised {type(e).__name__}: {e}"
        ) from None


def _import_file(path: str):
    """A module from a ``.py`` file (relative to the working directory), imported once."""
    import importlib.util
    import sys
    from pathlib import Path

    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise FileNotFoundError(f"no file {path}")
    name = f"rltrain_user_{file.stem}_{abs(hash(str(file))):x}"
    if name not in sys.modules:
        module_spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def with_deadline(timeout_s: float, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a thread: its value, what it raised, or TimeoutError after
    ``timeout_s`` (the user's code checked before any actor starts; a hung call is left behind)."""
    import threading

    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001  (handed to the caller)
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"did not return within {timeout_s:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
