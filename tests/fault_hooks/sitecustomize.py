"""Fault injection for tests/test_faults.py, kept out of rltrain: Python imports this module at the
start-up of every interpreter whose PYTHONPATH holds this folder (the trainer the test starts, and
its Ray actors). With ``RLTRAIN_TEST_HANG`` naming a file that says ``<rank> <optimizer steps>
<seconds>``, the learner of that rank sleeps (in :func:`planted_sleep`, which its stack shows) at
the start of the update after that many optimizer steps, once: the file is deleted first, so the
restarted run goes on."""

import os

if os.environ.get("RLTRAIN_TEST_HANG"):
    import importlib.abc
    import importlib.util
    import sys
    import time
    from pathlib import Path

    TARGET = "rltrain.learner.engine"

    def planted_sleep(seconds: float) -> None:
        time.sleep(seconds)

    def plant(module) -> None:
        """``EngineLearner.train_step`` first checks the file (every learner role inherits it)."""
        original = module.EngineLearner.train_step

        def train_step(self, groups):
            try:  # another rank may delete it between a check and the read
                rank, steps, seconds = Path(os.environ["RLTRAIN_TEST_HANG"]).read_text().split()
            except FileNotFoundError:
                rank = None
            if rank is not None and (int(rank), int(steps)) == (self.rank, self.optimizer_steps):
                os.unlink(os.environ["RLTRAIN_TEST_HANG"])
                planted_sleep(float(seconds))
            return original(self, groups)

        module.EngineLearner.train_step = train_step

    class PlantOnImport(importlib.abc.MetaPathFinder):
        """Finds nothing itself: when the engine module is first imported, its own spec is taken and
        its loading followed by :func:`plant`."""

        def find_spec(self, name, path=None, target=None):
            if name != TARGET:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            execute = spec.loader.exec_module

            def execute_and_plant(module) -> None:
                execute(module)
                plant(module)

            spec.loader.exec_module = execute_and_plant
            return spec

    sys.meta_path.insert(0, PlantOnImport())
