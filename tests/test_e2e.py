"""End to end on CPU: Ray + 2 DeepSpeed learners + 1 vLLM engine (+ tools)."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from dist_utils import free_port
from transformers import AutoModelForCausalLM, AutoTokenizer

from rltrain.config import Config
from rltrain.diagnostics import synthetic_rollouts
from rltrain.forward import sequence_logprobs
from rltrain.learner.group import LearnerGroup
from rltrain.rollout import GeneratorPool
from rltrain.run.weight_sync import CollectiveSync, ObjectStoreSync
from rltrain.sandbox import isolation_problem

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
# the demo's layout, small and without its warm start and evaluation; the dense "digits" reward makes a
# random model's updates differ from zero, so comparing weights between runs means something
SMALL = [
    "algorithm.prompts_per_step=4",
    "algorithm.group_size=4",
    "rollout.max_new_tokens=16",
    "algorithm.overlong_buffer=8",
    "learner.micro_batch_size=4",
    "reward.functions={math: 1.0, digits: 1.0}",
    "sft_warmup.steps=0",
    "run.eval_every=0",
    "run.ray_num_cpus=2",
]


def run_trainer(
    out_dir: Path, *overrides: str, env: dict | None = None, returncode: int = 0
) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rltrain.train",
            "--config",
            "configs/cpu_demo.yaml",
            *SMALL,
            f"run.output_dir={out_dir}",
            *overrides,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == returncode, done.stderr[-3000:]
    return done


def final_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(out_dir / "final_model").state_dict()


def test_training_run_writes_loadable_checkpoints_and_finite_metrics(tmp_path, ray_cluster):
    out = tmp_path / "run"
    done = run_trainer(
        out,
        "run.steps=3",
        "run.checkpoint_every=2",
        "loss.kl_beta=0.01",
        "loss.kl_estimator=k3+",
        "rollout.max_staleness=1",
        "rollout.inflight_updates=true",  # the next step's rollout takes new weights between chunks
        "rollout.inflight_chunk_tokens=8",
        "rollout.tools.enabled=[calculator,python]",
        # where the machine cannot isolate the python tool, run it with its limits alone
        *(["rollout.tools.sandbox.require_isolation=false"] if isolation_problem() else []),
        env=ray_cluster,
    )
    assert "step 3/3 reward" in done.stdout  # the per-step summary line
    assert done.stdout.strip().splitlines()[-1] == (  # the last line: where everything is
        f"rltrain: done; outputs in {out}/: final_model/ (loads with from_pretrained), checkpoints/ (resume "
        "with run.resume=true), metrics.jsonl, tensorboard/, curves.png, config.yaml"
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert all(math.isfinite(v) for v in row.values()), row
        assert row["train/tokens"] > 0 and row["train/kl"] >= 0
        assert row["rollout/stale_dropped"] == 0  # nothing is more than one version old
    # step 1 samples with the first weights; steps 2-3 were submitted a step ahead (one version old)
    # and may end under newer weights (0 <= mean <= 1)
    assert rows[0]["rollout/staleness_max"] == 0
    assert all(r["rollout/staleness_max"] == 1 and 0 <= r["rollout/staleness_mean"] <= 1 for r in rows[1:])
    for folder in ["checkpoints/step_2/hf", "checkpoints/step_3/hf", "final_model"]:
        model = AutoModelForCausalLM.from_pretrained(out / folder)
        assert sum(p.numel() for p in model.parameters()) > 0
    assert (out / "checkpoints" / "latest").read_text() == "step_3"
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "curves.png").stat().st_size > 0
    assert "masked_mean_denominator: token" in (out / "config.yaml").read_text()


# DAPO's dynamic sampling with a reward that leaves about half of the groups without variance: refill
# rounds take prompts between saves (and, with max_staleness, between the steps generated ahead)
REFILLING = [
    "algorithm.dynamic_sampling=true",
    "algorithm.group_size=2",
    "algorithm.max_sampling_rounds=3",
    "reward.functions={reward_fns:parity_reward: 1.0}",
]
TESTS_ON_PATH = {"PYTHONPATH": str(REPO / "tests")}  # the reward module

# The learner- and sampler-side layouts generate with the in-process engine (rollout.backend=hf), with
# less to start in each run
HF = "rollout.backend=hf"


def logged_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_rows(rows: list[dict], expected: list[dict], layout_keys: tuple[str, ...] = ()) -> None:
    """Equal metric rows but for wall-clock figures (time/, perf/), ``layout_keys``, and the check of
    each run's first weight sync (sync/probe_gap: a resumed run checks its own first sync too)."""
    assert len(rows) == len(expected)
    skipped = ("time/", "perf/", "sync/", *layout_keys)
    for row, want in zip(rows, expected):
        keys = {k for k in want if not k.startswith(skipped)}
        assert keys == {k for k in row if not k.startswith(skipped)}
        for k in sorted(keys):
            assert row[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), (row["step"], k)


def test_a_tied_output_head_is_synced_exported_and_a_sync_that_leaves_it_behind_is_stopped(
    ray_local, tmp_path
):
    # most pretrained checkpoints tie their output head to the input embeddings; named_parameters()
    # names the shared weight once (embed_tokens), and an engine reloading in place kept its first
    # head: vLLM sampled from stale logits, and the transformers backend refused the state dict
    import ray

    from rltrain.models.tiny import build_tiny_model
    from rltrain.run.weight_sync import SyncCheckFailed, check_sync

    path = str(build_tiny_model(tmp_path / "tied", tie_word_embeddings=True))
    config = {"learner": {"num_learners": 1, "zero_stage": 0, "lr": 0.05}}
    learners = LearnerGroup(Config.model_validate(config), path, total_optimizer_steps=1)

    def pool_config(backend: str) -> Config:
        return Config.model_validate({**config, "rollout": {"backend": backend}})

    engines = {backend: GeneratorPool(pool_config(backend), path) for backend in ("vllm", "hf")}
    batch = synthetic_rollouts()
    try:
        learners.train_step(batch)  # the head (= the embeddings) moves with every update
        state = learners.state_dict()
        assert "lm_head.weight" in state  # what the sync sends
        # the sync as it was: the tied head is left out, vLLM keeps its first one
        engines["vllm"].load_weights(ray.put({k: v for k, v in state.items() if k != "lm_head.weight"}), 1)
        with pytest.raises(
            SyncCheckFailed, match=r"the sync loads no weight into the engine's lm_head\.weight"
        ):
            check_sync(learners, engines["vllm"], batch, 0.0, 1)
        gaps, transports = {}, {}
        for backend, pool in engines.items():  # over the weight group: the head is sent once, loaded twice
            # vLLM's buckets through shared memory (one node), the transformers engine's through gloo
            rc = pool_config(backend).rollout.model_copy(
                update={"weight_sync_shared_memory": backend == "vllm"}
            )
            sync = CollectiveSync(learners, pool, False, rc)
            sync.push(learners, pool, 1)
            gaps[backend], transports[backend] = check_sync(learners, pool, batch, 0.0, 1), sync.backend
        learners.save_hf(tmp_path / "export")
    finally:
        learners.shutdown()
        for pool in engines.values():
            pool.shutdown()
    print(f"max |engine - learner| log-prob after the sync: {gaps}")
    assert max(gaps.values()) < 1e-4 and transports == {"vllm": "shm", "hf": "gloo"}
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(exported.model.embed_tokens.weight, state["model.embed_tokens.weight"])


def test_vllm_logprobs_match_the_learner_after_a_collective_sync_and_a_stuck_generator_is_named(
    ray_local, tiny_model_path
):
    import os
    import signal

    from rltrain.remote import ActorFailure

    temperature = 0.8
    config = Config.model_validate(
        {
            "learner": {"num_learners": 2, "zero_stage": 3, "lr": 0.05},
            # buckets of 64 KiB: the tiny model's 0.4 MB go in several, each gathered from ZeRO-3 shards
            "rollout": {"temperature": temperature, "max_new_tokens": 12, "num_engines": 2,
                        "weight_sync_bucket_mb": 1 / 16, "weight_sync_timeout_s": 5},
        }
    )  # fmt: skip
    learners = LearnerGroup(config, tiny_model_path, total_optimizer_steps=2)
    generators = GeneratorPool(config, tiny_model_path)
    prompts = [[5, 17, 99, 3, 250, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    try:
        sync = CollectiveSync(learners, generators, False, config.rollout)
        learners.train_step(synthetic_rollouts())  # the learners' weights now differ from the engine's
        stale = generators.prompt_logprobs(prompts)
        sync.push(learners, generators, 1)
        synced = generators.prompt_logprobs(prompts, every=True)
        completions = generators.collect(generators.submit(prompts, seeds=[1, 2]))
        # a judge's greedy replies (reward.judge): none within a millisecond, then the replies
        late = generators.complete(prompts, 6, timeout_s=1e-3)
        replies = generators.complete(prompts, 6, timeout_s=120)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        model.load_state_dict(learners.state_dict())
        # a generator that stops answering in a sync: named once the sync's time limit has passed
        stuck = generators.where()[1]["pid"]
        os.kill(stuck, signal.SIGSTOP)
        try:
            with pytest.raises(ActorFailure, match=r"^generator 1 did not finish the weight sync within "
                               r"rollout.weight_sync_timeout_s=5s"):  # fmt: skip
                sync.push(learners, generators, 2)
        finally:
            os.kill(stuck, signal.SIGCONT)
    finally:
        learners.shutdown()
        generators.shutdown()
    assert len(layout_buckets := sync.layout.buckets) > 2 and sync.backend == "shm", len(layout_buckets)
    assert synced[0] == synced[1]  # both engines took the same weights
    synced = synced[0]

    def learner_logprobs(seq, t):
        ids = torch.tensor([seq])
        return sequence_logprobs(model, ids, torch.ones_like(ids), temperature=t)[0][0]

    for seq, before, after, completion in zip(prompts, stale, synced, completions):
        # prompt log-probs are the raw model's (temperature 1)
        gap_before = (torch.tensor(before) - learner_logprobs(seq, 1.0)).abs().max().item()
        gap_after = (torch.tensor(after) - learner_logprobs(seq, 1.0)).abs().max().item()
        # sampled tokens carry log-probs of the distribution they were drawn from (temperature 0.8)
        sampled = learner_logprobs(seq + completion.token_ids, temperature)[len(seq) :]
        gap_sampled = (torch.tensor(completion.logprobs) - sampled).abs().max().item()
        print(
            f"max |vLLM - learner| log-prob: before sync {gap_before:.2e}, after {gap_after:.2e}, "
            f"sampled tokens {gap_sampled:.2e}"
        )
        assert gap_after < 1e-4 and gap_sampled < 1e-4
        assert gap_before > 1e-3  # the check would notice a sync that did nothing
    assert late == [None, None]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    for seq, reply in zip(prompts, replies):  # the synced weights' greedy continuation
        greedy = model.generate(torch.tensor([seq]), max_new_tokens=6, do_sample=False)[0, len(seq) :]
        # (a trailing incomplete UTF-8 sequence is held back, as vLLM's incremental detokenizer does)
        assert reply == tokenizer.decode(greedy, skip_special_tokens=True).rstrip("\ufffd")


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_sampled_log_probs_are_those_of_the_truncated_distribution_on_both_sides(
    backend, ray_local, tiny_model_path
):
    from rltrain.loss.logprobs import Truncation

    rollout = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "min_p": 0.02, "max_new_tokens": 24}
    config = Config.model_validate({"rollout": {"backend": backend, **rollout}})
    generators = GeneratorPool(config, tiny_model_path)
    prompts = [[5, 17, 99, 3, 250, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    try:
        completions = generators.collect(generators.submit(prompts, seeds=[1, 2]))
    finally:
        generators.shutdown()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    truncation = Truncation(top_k=40, top_p=0.9, min_p=0.02)
    for seq, completion in zip(prompts, completions):
        ids = torch.tensor([seq + completion.token_ids])
        truncated = sequence_logprobs(model, ids, torch.ones_like(ids), 0.8, truncation=truncation)[0][
            0, len(seq) :
        ]
        whole = sequence_logprobs(model, ids, torch.ones_like(ids), 0.8)[0][0, len(seq) :]
        engine = torch.tensor(completion.logprobs)
        gap, whole_gap = (engine - truncated).abs().max().item(), (engine - whole).abs().max().item()
        print(
            f"{backend}: max |engine - learner| log-prob {gap:.2e}; against the whole distribution {whole_gap:.2e}"
        )
        assert gap < 1e-4
        assert whole_gap > 1e-2  # truncation changed these log-probs: a learner without it would be biased


def test_a_reward_function_that_fails_every_call_is_shown_once_and_stops_the_run(tmp_path, ray_cluster):
    # raises_unless_right passes the check before the run (called with the answer as the completion)
    # and raises on whatever the random model writes: every call of step 1 fails
    out = tmp_path / "run"
    done = run_trainer(out, "run.steps=3", "rollout.backend=hf",
                       "reward.functions={reward_fns:raises_unless_right: 1.0, digits: 1.0}",
                       env={**TESTS_ON_PATH, **ray_cluster}, returncode=1)  # fmt: skip
    kind, file = (
        "reward function reward_fns:raises_unless_right",
        "reward_function_reward_fns_raises_unless_right.txt",
    )
    assert done.stderr.count(f"the {kind} failed (") == 1  # its first failure, shown once
    last = done.stderr.strip().splitlines()[-1]
    assert re.match(rf"rltrain: step 1: every call of the {kind} failed for 1 step\(s\) in a row \((\d+) of \1 "
                    r"this step: ValueError: cannot score .*\); its first traceback: .*errors/", last), last  # fmt: skip
    assert (
        last.endswith(f"{file}; stopping (run.max_user_failure_steps=1)") and "Traceback" not in done.stderr
    )
    assert 'raise ValueError(f"cannot score' in (out / "errors" / file).read_text()  # the user's own line


def test_mismatch_guard_stops_a_run_whose_engine_keeps_its_first_synced_weights(
    ray_local, tmp_path, monkeypatch
):
    from rltrain.config import load_config
    from rltrain.run.loop import RunFailed, train

    # the sync "succeeds" (the engine is told each new version) but always sends the first weights
    # it sent: the engine samples from step 1's weights for good
    def stuck_push(self, learners, generators, version):
        self.first = getattr(self, "first", None) or learners.gathered_state_ref()
        generators.load_weights(self.first, version)
        return 0.0

    monkeypatch.setattr(ObjectStoreSync, "push", stuck_push)
    # the guard's default (auto: 1e-2, no staleness here)
    overrides = [*SMALL, f"run.output_dir={tmp_path}", "run.steps=10", "run.checkpoint_every=0",
                 "rollout.weight_sync=object_store"]  # fmt: skip
    with pytest.raises(
        RunFailed, match=r"step \d+: rollout/mismatch_kl = .* > run.max_mismatch_kl = auto: 0.01"
    ):
        train(load_config(str(REPO / "configs/cpu_demo.yaml"), overrides))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # steps 1 and 2 sample from the weights the learners hold (fp32: rounding only); from step 3 on
    # the learner has moved and the engine has not (3e-3 at step 3 here, growing with every update),
    # and the default stops the run within a few steps
    assert rows[0]["rollout/mismatch_kl"] < 1e-10 and rows[1]["rollout/mismatch_kl"] < 1e-10
    assert 3 <= len(rows) < 10 and rows[-1]["rollout/mismatch_kl"] > 1e-2
    assert all(row["rollout/mismatch_kl"] <= 1e-2 for row in rows[:-1])
    assert all(row["rollout/staleness_max"] == 0 for row in rows)  # the versions themselves look fine


def test_samples_from_an_engine_whose_weights_never_arrive_are_dropped_not_trained_on(
    ray_local, tmp_path, monkeypatch
):
    from rltrain.config import load_config
    from rltrain.run.loop import train

    # no weights and no version reach the engine: everything it samples after step 1 is from version 0
    monkeypatch.setattr(ObjectStoreSync, "push", lambda self, learners, generators, version: 0.0)
    # (run.check_sync would stop this run at its first sync, which is the point of that check)
    overrides = [*SMALL, f"run.output_dir={tmp_path}", "run.steps=3", "run.checkpoint_every=0",
                 "rollout.max_staleness=1", "run.check_sync=false", "rollout.weight_sync=object_store"]  # fmt: skip
    train(load_config(str(REPO / "configs/cpu_demo.yaml"), overrides))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    sequences = 4 * 4  # SMALL: 4 prompts x 4 completions a step
    # step s trains on the learners' version s-1; the engine stays at version 0, so step 1 and 2's
    # samples are 0 and 1 versions old (kept, max_staleness=1) and step 3's are 2 old: all dropped
    assert [row["rollout/staleness_max"] for row in rows[:2]] == [0, 1]
    assert rows[0]["rollout/stale_dropped"] == rows[1]["rollout/stale_dropped"] == 0
    assert rows[2]["rollout/stale_dropped"] == sequences and rows[2]["train/skipped"] == 1


def test_bundles_no_node_can_place_stop_the_run_in_one_line_within_the_startup_timeout(ray_local, tmp_path):
    import ray
    from ray.util.placement_group import placement_group_table

    from rltrain.config import load_config
    from rltrain.run.loop import RunFailed, train

    # two learners on two different nodes (STRICT_SPREAD) of a one-node cluster: the CPUs suffice in
    # all, but no placement ever exists (it waited forever)
    overrides = [*SMALL, HF, f"run.output_dir={tmp_path}", "run.steps=1", "learner.placement=STRICT_SPREAD",
                 "run.startup_timeout_s=3"]  # fmt: skip
    with pytest.raises(RunFailed) as stopped:
        train(load_config(str(REPO / "configs/cpu_demo.yaml"), overrides))
    message = str(stopped.value)
    assert "\n" not in message and message.startswith(
        "the policy learners: Ray could not place 2 x 0.5 CPU (STRICT_SPREAD) within run.startup_timeout_s=3s; "
        "the cluster has 1 node(s) (4 CPU), free now: "
    ), message
    # nothing of the run is left: its generator and its placement group are gone, every CPU free
    # again (an earlier test's actors may still be releasing theirs as this one starts: Ray kills
    # actors asynchronously, so the count is awaited, not compared with one taken at the start)
    assert all(group["state"] == "REMOVED" for group in placement_group_table().values())
    total = ray.cluster_resources()["CPU"]
    deadline = time.monotonic() + 60
    while ray.available_resources().get("CPU") != total and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == total


def test_a_step_without_an_update_still_advances_the_engines_version(ray_local, tmp_path, monkeypatch):
    from rltrain.config import load_config
    from rltrain.run.loop import train
    from rltrain.run.orchestrator import Orchestrator

    batch = Orchestrator.next_batch

    def nothing_at_steps_1_and_3(self, step):  # as a step whose every group was filtered out
        scored = batch(self, step)
        return (
            scored.keep(torch.zeros(len(scored.prompts), dtype=torch.bool), 4) if step in (1, 3) else scored
        )

    monkeypatch.setattr(Orchestrator, "next_batch", nothing_at_steps_1_and_3)
    # stopped after step 3 of 4 by run.stop_after, a step skipped: the stop and its checkpoint hold
    # all the same (with a checkpoint to resume from, no final model); the loss is DPPO's (Binary-KL)
    overrides = [
        *SMALL,
        f"run.output_dir={tmp_path}",
        "run.steps=4",
        "run.stop_after=3",
        "run.checkpoint_every=0",
        "loss.kind=dppo",
        "loss.dppo_divergence=kl",
    ]
    train(load_config(str(REPO / "configs/cpu_demo.yaml"), overrides))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and (tmp_path / "checkpoints" / "latest").read_text() == "step_3"
    assert not (tmp_path / "final_model").exists()
    assert rows[0]["train/skipped"] == 1 and rows[2]["train/skipped"] == 1
    # step 2 is sampled after step 1 (rollout.max_staleness=0) by the learners' weights, unchanged
    # since step 1 skipped its update: fresh, not a version old, so nothing is dropped and it trains
    assert rows[1]["rollout/staleness_max"] == 0 and rows[1]["rollout/stale_dropped"] == 0
    assert "train/skipped" not in rows[1] and rows[1]["train/tokens"] > 0
    masked = rows[1]["loss/dppo_masked_low"] + rows[1]["loss/dppo_masked_high"]
    assert 0 <= masked <= 1 and rows[1]["train/clip_fraction"] == pytest.approx(masked)


def test_ray_job_submit_against_a_local_head_and_a_run_without_ray_address_leaves_that_head_alone(tmp_path):
    venv_bin = str(Path(sys.executable).parent)
    temp_dir = tempfile.mkdtemp(prefix="rayjob", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    # RAY_TMPDIR: where the head writes its address file, and where ray.init() looks for one
    env = {**os.environ, "PATH": f"{venv_bin}:{os.environ['PATH']}", "RAY_AUTH_MODE": "disabled",
           "RAY_TMPDIR": temp_dir}  # fmt: skip
    env.pop("RAY_ADDRESS", None)
    ray = str(Path(venv_bin) / "ray")
    # Its own ports throughout: another Ray instance on this machine (this test session's) holds the
    # defaults, and a job agent that cannot bind its port never registers ("No available agent").
    ports = [
        "--port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "runtime-env-agent-port",
        "metrics-export-port",
    ]
    port_args = [f"--{name.removeprefix('--')}={free_port()}" for name in ports]
    # --block keeps the head's processes in this process group, so the test stops exactly this head
    # (`ray stop` would kill every Ray process on the machine, other test clusters included)
    head = subprocess.Popen(
        [ray, "start", "--head", "--block", "--num-cpus=2", *port_args, "--dashboard-host=127.0.0.1",
         "--include-dashboard=true", "--dashboard-port=8265"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )  # fmt: skip
    try:
        wait_for_dashboard("http://127.0.0.1:8265/api/version", timeout_s=120)
        out = tmp_path / "job"
        submit = [ray, "job", "submit", "--address", "http://127.0.0.1:8265", "--working-dir", ".", "--",
                  "python", "-m", "rltrain.train", "--config", "configs/cpu_demo.yaml", *SMALL, "run.steps=2",
                  f"run.output_dir={out}", HF]  # fmt: skip
        for _attempt in range(30):  # the dashboard answers before its job agent has registered
            done = subprocess.run(submit, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
            if "No available agent to submit job" not in done.stderr:
                break
            time.sleep(2)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        assert "succeeded" in done.stdout
        # the outputs are where the job's last line says: the absolute path it was given
        said = re.search(r"rltrain: done; outputs in (\S+)/: ", done.stdout)
        assert said and Path(said.group(1)) == out, done.stdout[-3000:]
        assert (out / "final_model" / "config.json").exists()

        # ray.init() alone joins a local instance it finds running (the head's address file under
        # RAY_TMPDIR) and then refuses num_cpus: "When connecting to an existing cluster, num_cpus and
        # num_gpus must not be provided". A run without RAY_ADDRESS starts its own instead, on free
        # ports even where Ray's default port is held by something else too (where it is free to hold)
        theirs = (Path(temp_dir) / "ray" / "ray_current_cluster").read_text().strip()
        code = ("import socket; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                "try:\n    s.bind(('0.0.0.0', 6379)); s.listen()\nexcept OSError:\n    pass\n"
                "from rltrain.config import load_config; from rltrain.run.launch import connect_ray; import ray\n"
                "connect_ray(load_config(None, ['run.ray_num_cpus=4'])); print(ray.get_runtime_context().gcs_address)")  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
        )
        assert done.returncode == 0, done.stderr[-2000:]
        ours = done.stdout.strip().splitlines()[-1]
        assert theirs and ours and ours != theirs
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)


def wait_for_dashboard(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
