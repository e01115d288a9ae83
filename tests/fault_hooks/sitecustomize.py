"""Fault injection for the tests that kill, hang or interrupt runs, kept out of rltrain: Python
imports this module at the start-up of every interpreter whose PYTHONPATH holds this folder (the
trainer a test starts, and its Ray actors where they start with that environment). Each fault
waits for an event, never for a time:

- ``RLTRAIN_TEST_HANG`` names a file that says ``<rank> <optimizer steps> <seconds>``: the learner
  of that rank sleeps (in :func:`planted_sleep`, which its stack shows) at the start of the update
  after that many optimizer steps, once; the file is deleted first, so the restarted run goes on.
- ``RLTRAIN_TEST_HOLD_SAVE`` names a folder: the driver, writing checkpoint ``step_<k>`` with ``k`` at
  least the number in ``<folder>/from`` (1 if absent), holds inside the save (its ``.partial``
  folder written but for the rename) after creating ``<folder>/saving_<k>``, until
  ``<folder>/release`` exists. A test then kills or interrupts the run mid-save on that event,
  however fast or slow the machine.
"""

import os

TARGETS = {}  # module name -> what to plant in it once it is imported

if os.environ.get("RLTRAIN_TEST_HANG"):
    import time
    from pathlib import Path

    def planted_sleep(seconds: float) -> None:
        time.sleep(seconds)

    def plant_hang(module) -> None:
        """``EngineLearner.train_step`` first checks the file (every learner role inherits it)."""
        original = module.EngineLearner.train_step

        def train_step(self, groups, *args, **kwargs):
            try:  # another rank may delete it between a check and the read
                rank, steps, seconds = Path(os.environ["RLTRAIN_TEST_HANG"]).read_text().split()
            except FileNotFoundError:
                rank = None
            if rank is not None and (int(rank), int(steps)) == (self.rank, self.optimizer_steps):
                os.unlink(os.environ["RLTRAIN_TEST_HANG"])
                planted_sleep(float(seconds))
            return original(self, groups, *args, **kwargs)

        module.EngineLearner.train_step = train_step

    TARGETS["rltrain.learner.engine"] = plant_hang

if os.environ.get("RLTRAIN_TEST_HOLD_SAVE"):
    import time
    from pathlib import Path

    def plant_hold(module) -> None:
        """``_write`` of a checkpoint's trainer state (the last file of its ``.partial`` folder but
        the model's) holds once it has written it."""
        folder = Path(os.environ["RLTRAIN_TEST_HOLD_SAVE"])
        original = module._write

        def _write(path, write):
            result = original(path, write)
            partial = Path(path).parent
            if Path(path).name == module.TRAINER_STATE and partial.name.endswith(module.PARTIAL):
                step = int(partial.name[len("step_") : -len(module.PARTIAL)])
                start = int((folder / "from").read_text()) if (folder / "from").exists() else 1
                if step >= start:
                    (folder / f"saving_{step}").write_text("")
                    while not (folder / "release").exists():
                        time.sleep(0.01)
            return result

        module._write = _write

    TARGETS["rltrain.run.checkpoint"] = plant_hold

if TARGETS:
    import importlib.abc
    import importlib.util
    import sys

    class PlantOnImport(importlib.abc.MetaPathFinder):
        """Finds nothing itself: when a target module is first imported, its own spec is taken and
        its loading followed by its planter."""

        def find_spec(self, name, path=None, target=None):
            if name not in TARGETS:
                return None
            planter = TARGETS.pop(name)
            sys.meta_path.remove(self)  # (the module's own spec, past this finder)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                if TARGETS:  # another target still to come
                    sys.meta_path.insert(0, self)
            execute = spec.loader.exec_module

            def execute_and_plant(module) -> None:
                execute(module)
                planter(module)

            spec.loader.exec_module = execute_and_plant
            return spec

    sys.meta_path.insert(0, PlantOnImport())
