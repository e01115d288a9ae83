"""`rltrain serve` driven by the unmodified Tinker SDK (and a tinker-cookbook recipe): each server
is the command line's own process, joined to the session's Ray instance, on one output folder, so a
second server resumes what the first saved. The model is the built-in tiny one, served by its
folder's path (the SDK finds a tokenizer there: three or more slashes)."""

import base64
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

tinker = pytest.importorskip("tinker")
import tinker_cookbook  # noqa: E402
from tinker import types  # noqa: E402
from tinker_hostile import hostile_requests  # noqa: E402

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
KEY = "tml-rltrain-tests"

# six datums of 3 to 9 tokens, their targets and cross-entropy weights (0 leaves a token out)
DATA = [
    ([5, 6, 7], [6, 7, 8], [1.0, 1.0, 1.0]),
    ([10, 11, 12, 13, 14], [11, 12, 13, 14, 15], [0.0, 0.0, 1.0, 1.0, 1.0]),
    ([20, 20, 21, 22], [21, 22, 23, 24], [0.5, 0.5, 2.0, 2.0]),
    ([30, 31, 32, 33, 34, 35, 36, 37, 38], [31, 32, 33, 34, 35, 36, 37, 38, 39], [1.0] * 9),
    ([40, 41, 42], [41, 42, 43], [0.0, 0.0, 2.0]),
    ([50, 51, 52, 53, 54, 55], [51, 52, 53, 54, 55, 56], [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]),
]
# AdamW's first step moves each weight by lr * g / (|g| + eps) (m / (1 - b1) = g, sqrt(v / (1 - b2)) = |g|):
# with eps = 0.1 the step depends on each gradient's size, not its sign alone
ADAM = types.AdamParams(learning_rate=1e-2, eps=0.1, weight_decay=0.0, grad_clip_norm=0.0)


def datums(rows):
    return [types.Datum(model_input=types.ModelInput.from_ints(t), loss_fn_inputs={"target_tokens": y, "weights": w})
            for t, y, w in rows]  # fmt: skip


@contextlib.contextmanager
def serving(out: Path, base: str, env: dict, *overrides: str):
    """``rltrain serve`` on ``out``: its base URL once it listens, and the lines it has printed;
    stopped at the end."""
    cmd = [sys.executable, "-m", "rltrain.train", "serve", "--config", "configs/cpu_tinker.yaml", "serve.port=0",
           f"serve.base_models=[{base}]", f"run.output_dir={out}", "serve.session_timeout_s=30", *overrides]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines: list[str] = []
    found = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "the Tinker API at http://" in line:
                found.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not found.wait(180):
            raise AssertionError("rltrain serve did not start:\n" + "".join(lines[-40:]))
        url = re.search(r"at (http://\S+) ", next(x for x in lines if "the Tinker API at" in x)).group(1)
        yield url, lines
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def long_context_model(tiny_model_path, tmp_path_factory) -> str:
    """The tiny model with a context of 4096 (its rotary positions need no more weights)."""
    import shutil

    folder = tmp_path_factory.mktemp("long") / "model"
    shutil.copytree(tiny_model_path, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return str(folder)


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_model_path, long_context_model, tmp_path_factory, monkeypatch_module):
    out = tmp_path_factory.mktemp("tinker_runs")
    monkeypatch_module.setenv("TINKER_API_KEY", KEY)
    monkeypatch_module.setenv("TINKER_TELEMETRY", "0")
    env = {**ray_cluster, "TINKER_TELEMETRY": "0"}
    # 2 learners (ZeRO-2) taking micro-batches of 2 datums, 1 vLLM engine; a call waits 5 s for a
    # lower seq_id that has not arrived (the SDK leaves no gap: a refused call's place is passed over);
    # three models at once; request bodies up to 8 MiB (the SDK sends chunks of at most 5 MB)
    with serving(
        out,
        f"{tiny_model_path},{long_context_model}",
        env,
        "learner.micro_batch_size=2",
        "serve.order_timeout_s=5",
        "serve.max_models=3",
        "serve.max_request_mib=8",
    ) as (url, lines):
        yield {"url": url, "out": out, "base": tiny_model_path, "long": long_context_model, "env": env,
               "lines": lines}  # fmt: skip


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def state_weights(out: Path, path: str) -> dict[str, torch.Tensor]:
    """The trained weights a ``tinker://`` saved state holds (layout-free, by parameter name)."""
    folder = out / "tinker" / path.removeprefix("tinker://")
    return torch.load(folder / "state.pt", weights_only=True)["weights"]


def reference(base: str, adapter: Path, rows):
    """The model's own eager forward of each datum alone (the base model and the saved adapter, in
    peft): each datum's target log-probs, the cross-entropy sum, each adapter weight's gradient."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    total, logprobs = 0.0, []
    for tokens, targets, weights in rows:
        lp = model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
        lp = lp.gather(-1, torch.tensor(targets)[:, None])[:, 0]
        total = total + (-(torch.tensor(weights) * lp)).sum()  # a sum over tokens, no mean
        logprobs.append(lp.detach())
    total.backward()
    return (
        logprobs,
        float(total.detach()),
        {n: p.grad for n, p in model.named_parameters() if p.requires_grad},
    )


def refused(call, *words: str) -> str:
    """``call()`` fails as the caller's error (category user), its message naming ``words``."""
    with pytest.raises((tinker.BadRequestError, tinker.RequestFailedError)) as caught:
        call()
    error = caught.value
    category = getattr(error, "category", None) or (error.body or {}).get("category")
    assert str(category).lower().endswith("user"), (category, str(error))
    for word in words:
        assert word in str(error), (word, str(error))
    return str(error)


def test_a_step_is_the_hand_computed_sum_in_any_split_of_calls_learners_and_zero_stage(server):
    out, base = server["out"], server["base"]
    with tinker.ServiceClient(base_url=server["url"]) as sc:
        tc = sc.create_lora_training_client(base_model=base, rank=4, seed=3, train_unembed=False).result()
        init = tc.save_state("init").result().path
        fb = tc.forward_backward(datums(DATA), "cross_entropy").result()
        step = tc.optim_step(ADAM).result()
        one = tc.save_state("one").result().path
        # the same data as three calls (2, 1 and 3 datums: one rank holds none in the second)
        tc.load_state_with_optimizer(init).result()
        for part in (DATA[:2], DATA[2:3], DATA[3:]):
            tc.forward_backward(datums(part), "cross_entropy").result()
        tc.optim_step(ADAM).result()
        three = tc.save_state("three").result().path

    logprobs, total, grads = reference(
        base, out / "tinker" / init.removeprefix("tinker://") / "adapter", DATA
    )
    for got, want in zip(fb.loss_fn_outputs, logprobs):  # each datum's, in the datums' order
        assert got["logprobs"].to_torch() == pytest.approx(want, abs=1e-5)
    assert fb.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)  # the sum: no token mean
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
    assert step.metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-4)
    before, after = state_weights(out, init), state_weights(out, one)
    assert set(after) == set(grads)
    for name, g in grads.items():  # AdamW's first step, by hand (see ADAM)
        want = before[name] - 1e-2 * g / (g.abs() + 0.1)
        assert torch.allclose(after[name], want, atol=1e-6), name
    assert any(float((after[n] - before[n]).abs().max()) > 1e-4 for n in grads)  # (something moved)
    for name, w in state_weights(out, three).items():
        assert torch.allclose(w, after[name], atol=1e-6), name
    alone = side_by_side(server["url"], server["lines"], init, out)
    # a model made once those sessions ended trains on learners one of them released, restarted on
    # its own seed and adapters (serve.kept_learners): its start is the first model's, bit for bit
    started = learner_pids(server)
    released(server, len(started))
    with tinker.ServiceClient(base_url=server["url"]) as sc:
        tc = sc.create_lora_training_client(base_model=base, rank=4, seed=3, train_unembed=False).result()
        again = state_weights(out, tc.save_state("init-again").result().path)
    assert learner_pids(server)[-1] in started, (learner_pids(server), started)
    first = state_weights(out, init)
    assert set(again) == set(first) and all(torch.equal(again[n], first[n]) for n in first)

    # one learner (packed micro-batches), and two under ZeRO-3 taking one datum at a time, each a
    # server of its own on the same folder resuming the saved state with its optimizer
    for layout in (["learner.num_learners=1", "learner.packing=true"],
                   ["learner.zero_stage=3", "learner.micro_batch_size=1"]):  # fmt: skip
        with serving(out, base, server["env"], *layout) as (url, lines):
            with tinker.ServiceClient(base_url=url) as sc:
                tc = sc.create_training_client_from_state_with_optimizer(init).result()
                tc.forward_backward(datums(DATA), "cross_entropy").result()
                assert tc.optim_step(ADAM).result().metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-4)
                other = state_weights(out, tc.save_state("layout").result().path)
            if "learner.zero_stage=3" in layout:
                for got, want in zip(side_by_side(url, lines, init, out), alone):
                    for name, w in got.items():  # (and each model's weights alone, as under ZeRO-2)
                        assert torch.allclose(w, want[name], atol=1e-6), (layout, name)
        for name, w in other.items():
            assert torch.allclose(w, after[name], atol=1e-6), (layout, name)


def side_by_side(url: str, lines: list[str], init: str, out: Path) -> list[dict[str, torch.Tensor]]:
    """Two models from ``init`` trained side by side on one server, by two clients whose calls
    interleave (every call sent before any result is read), one on DATA[:3] in two calls and one on
    DATA[3:]: the weights each ends with, which are those each gets alone, trained first here. The
    models share one set of learners (serve.models_per_learners), which hold one model's state at a
    time: the first model's gradient of its first call is set aside while the second's call runs."""
    halves = [[DATA[:2], DATA[2:3]], [DATA[3:]]]
    alone = []
    with tinker.ServiceClient(base_url=url) as sc:
        tc = sc.create_training_client_from_state_with_optimizer(init).result()
        for i, calls in enumerate(halves):
            tc.load_state_with_optimizer(init).result()
            for part in calls:
                tc.forward_backward(datums(part), "cross_entropy").result()
            tc.optim_step(ADAM).result()
            alone.append(state_weights(out, tc.save_state(f"alone-{i}").result().path))
    with tinker.ServiceClient(base_url=url) as one, tinker.ServiceClient(base_url=url) as two:
        clients = [sc.create_training_client_from_state_with_optimizer(init).result() for sc in (one, two)]
        first, second = learner_pids({"lines": lines})[-2:]
        assert first == second  # (the same learners)
        sent = [clients[0].forward_backward(datums(halves[0][0]), "cross_entropy"),
                clients[1].forward_backward(datums(halves[1][0]), "cross_entropy"),
                clients[0].forward_backward(datums(halves[0][1]), "cross_entropy"),
                clients[1].optim_step(ADAM), clients[0].optim_step(ADAM)]  # fmt: skip
        for future in sent:
            future.result()
        together = [
            state_weights(out, tc.save_state(f"together-{i}").result().path) for i, tc in enumerate(clients)
        ]
    for got, want in zip(together, alone):
        for name, w in want.items():
            assert torch.allclose(got[name], w, atol=1e-6), name
    assert any(float((alone[0][n] - alone[1][n]).abs().max()) > 1e-4 for n in alone[0])  # (they differ)
    return together


def logprobs_of(tc, tokens: list[int]) -> list[float]:
    """The training model's log-probs of ``tokens[1:]``, each given what precedes it (a forward)."""
    out = tc.forward(datums([(tokens[:-1], tokens[1:], [1.0] * (len(tokens) - 1))]), "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].tolist()


def test_samples_come_from_their_sampling_clients_weights_never_stale_ones(server):
    base, seq = server["base"], types.ModelInput.from_ints([5, 6, 7, 8, 9, 10])
    with tinker.ServiceClient(base_url=server["url"]) as sc:
        # the base model sampled with no model live (the engines start for it)
        base_sampler = sc.create_sampling_client(base_model=base).result()
        # train_unembed (the SDK's default): the engines take merged weights (vLLM has no head adapters)
        tc = sc.create_lora_training_client(base_model=base, rank=4, seed=1).result()
        before = tc.save_weights_and_get_sampling_client().result()
        lp_before = before.compute_logprobs(seq).result()
        assert lp_before[0] is None and lp_before[1:] == pytest.approx(
            logprobs_of(tc, seq.to_ints()), abs=1e-4
        )
        tc.forward_backward(datums(DATA), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        after = tc.save_weights_and_get_sampling_client().result()
        lp_after = after.compute_logprobs(seq).result()
        assert lp_after[1:] == pytest.approx(logprobs_of(tc, seq.to_ints()), abs=1e-4)
        assert max(abs(a - b) for a, b in zip(lp_after[1:], lp_before[1:])) > 1e-2  # (the step moved them)
        # an older snapshot and the base model still sample from their own weights
        assert before.compute_logprobs(seq).result()[1:] == pytest.approx(lp_before[1:], abs=1e-5)
        assert base_sampler.compute_logprobs(seq).result()[1:] == pytest.approx(lp_before[1:], abs=1e-4)
        last = after.compute_logprobs(seq, prompt_logprobs_last_n=2).result()
        assert last[:4] == [None] * 4 and last[4:] == pytest.approx(lp_after[4:], abs=1e-5)

        prompt, params = types.ModelInput.from_ints([5, 6, 7]), types.SamplingParams(max_tokens=6, seed=11)
        drawn = after.sample(prompt, 3, params).result().sequences
        assert len(drawn) == 3 and all(len(s.tokens) <= 6 for s in drawn)
        assert [s.tokens for s in after.sample(prompt, 3, params).result().sequences] == [
            s.tokens for s in drawn
        ]
        assert len({tuple(s.tokens) for s in drawn}) > 1  # three samples, not one thrice
        for s in drawn:  # each sampled token's log-prob is the trained model's (temperature 1)
            assert s.logprobs == pytest.approx(logprobs_of(tc, [5, 6, 7, *s.tokens])[2:], abs=1e-4)
            assert s.stop_reason == ("length" if len(s.tokens) == 6 else "stop")
        greedy = (
            after.sample(prompt, 2, types.SamplingParams(max_tokens=6, top_k=1, seed=1)).result().sequences
        )
        zero = after.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result().sequences
        assert greedy[0].tokens == greedy[1].tokens == zero[0].tokens
        # a stop token: the same seeded sample, cut at its first occurrence (kept), stopped
        first = drawn[0].tokens
        stop = first[2]
        cut = (
            after.sample(prompt, 1, types.SamplingParams(max_tokens=6, seed=11, stop=[stop]))
            .result()
            .sequences[0]
        )
        assert cut.tokens == first[: first.index(stop) + 1] and cut.stop_reason == "stop"
        # a stop string: the first printable ASCII character of a seeded sample (the tokenizer is
        # byte-level: the bytes before it, all 0x80 or above, decode to no ASCII character)
        long = (
            after.sample(prompt, 1, types.SamplingParams(max_tokens=20, seed=5)).result().sequences[0].tokens
        )
        text = [tc.get_tokenizer().decode([t]) for t in long]
        k = next(i for i, c in enumerate(text) if c.isascii() and c.isprintable() and c)
        stopped = after.sample(prompt, 1, types.SamplingParams(max_tokens=20, seed=5, stop=text[k])).result()
        assert stopped.sequences[0].tokens == long[: k + 1] and stopped.sequences[0].stop_reason == "stop"
        # concurrent requests (each its own prompt, count, seed and settings) go to vLLM as one
        # batch: each gets what it gets alone
        asks = [(types.ModelInput.from_ints([5 + i] * (1 + i % 3)), 1 + i % 3,
                 types.SamplingParams(max_tokens=3 + i % 4, seed=100 + i, temperature=0.7 + 0.1 * (i % 3)))
                for i in range(8)]  # fmt: skip
        together = [after.sample(*ask) for ask in asks]
        scored = after.compute_logprobs(seq)
        for ask, future in zip(asks, together):
            alone = after.sample(*ask).result().sequences
            got = future.result().sequences
            assert [s.tokens for s in got] == [s.tokens for s in alone] and len(got) == ask[1]
            for a, b in zip(got, alone):
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert scored.result()[1:] == pytest.approx(lp_after[1:], abs=1e-4)
        # named sampler weights saved again under the same name: every sampler of the path samples
        # from the new ones (the engines held that name, and reloaded only on a new one)
        named = tc.save_weights_for_sampler("same").result().path
        by_name = sc.create_sampling_client(model_path=named).result()
        assert by_name.compute_logprobs(seq).result()[1:] == pytest.approx(lp_after[1:], abs=1e-4)
        tc.forward_backward(datums(DATA), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        tc.save_weights_for_sampler("same").result()
        lp_now = logprobs_of(tc, seq.to_ints())
        assert max(abs(a - b) for a, b in zip(lp_now, lp_after[1:])) > 1e-2
        assert by_name.compute_logprobs(seq).result()[1:] == pytest.approx(lp_now, abs=1e-4)
        again = sc.create_sampling_client(model_path=named).result()
        assert again.compute_logprobs(seq).result()[1:] == pytest.approx(lp_now, abs=1e-4)
        assert after.compute_logprobs(seq).result()[1:] == pytest.approx(lp_after[1:], abs=1e-5)  # (its own)


def test_adapters_of_several_models_sample_side_by_side_each_from_its_own_weights(server):
    base, seq = server["base"], types.ModelInput.from_ints([5, 6, 7, 8, 9, 10])
    with tinker.ServiceClient(base_url=server["url"]) as sc:
        # without train_unembed the engines serve adapters, each sampling client's its own, in one batch
        a = sc.create_lora_training_client(base_model=base, rank=4, seed=5, train_unembed=False).result()
        b = sc.create_lora_training_client(base_model=base, rank=4, seed=6, train_unembed=False).result()
        a_before = a.save_weights_and_get_sampling_client().result()
        at_start = logprobs_of(a, seq.to_ints())  # (fresh adapters: the base model's)
        for tc, rate in ((a, 0.05), (b, 0.1)):
            tc.forward_backward(datums(DATA), "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=rate)).result()
        a_after, b_after = (tc.save_weights_and_get_sampling_client().result() for tc in (a, b))
        base_sampler = sc.create_sampling_client(base_model=base).result()
        want = {a_before: at_start, base_sampler: at_start, a_after: logprobs_of(a, seq.to_ints()),
                b_after: logprobs_of(b, seq.to_ints())}  # fmt: skip
        assert max(abs(x - y) for x, y in zip(want[a_after], want[b_after])) > 1e-2
        assert max(abs(x - y) for x, y in zip(want[a_after], at_start)) > 1e-2
        prompt, params = types.ModelInput.from_ints([5, 6, 7]), types.SamplingParams(max_tokens=5, seed=4)
        alone = {s: s.sample(prompt, 2, params).result().sequences for s in (a_after, b_after)}
        # every client at once, interleaved: each request from its own weights (the base model's
        # requests too, which vLLM's LoRA layers would give the last adapter's otherwise)
        asked = [(s, s.compute_logprobs(seq)) for _ in range(3) for s in want]
        drawn = [(s, s.sample(prompt, 2, params)) for _ in range(2) for s in (a_after, b_after)]
        for s, future in asked:
            assert future.result()[1:] == pytest.approx(want[s], abs=1e-4)
        for s, future in drawn:
            got = future.result().sequences
            assert [x.tokens for x in got] == [x.tokens for x in alone[s]]
            for x in got:
                assert x.logprobs == pytest.approx(
                    logprobs_of(a if s is a_after else b, [5, 6, 7, *x.tokens])[2:], abs=1e-4
                )


def test_refusals_name_what_is_refused_and_touch_nothing(server):
    base, good = server["base"], datums(DATA[:2])
    with tinker.ServiceClient(base_url=server["url"]) as sc:
        tc = sc.create_lora_training_client(base_model=base, rank=2, train_unembed=False).result()
        first = tc.forward(good, "cross_entropy").result().loss_fn_outputs

        def fb(data, loss="cross_entropy", config=None):
            return lambda: tc.forward_backward(data, loss, loss_fn_config=config).result()

        rl = {"logprobs": [-1.0, -1.0, -1.0], "advantages": [1.0, float("nan"), 0.0]}
        rl_datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                               loss_fn_inputs={"target_tokens": [6, 7, 8], **rl})  # fmt: skip
        long = list(range(1, 200)) * 6  # 1194 tokens: past the context of 1024
        for call, words in [
            (fb(good, "stable_reinforce"), ["stable_reinforce"]),
            (fb(good, "ppo", {"clip_ratio": 0.2}), ["clip_ratio"]),
            (fb([rl_datum], "cispo"), ["clip_low_threshold"]),
            (fb([rl_datum], "importance_sampling"), ["advantages", "NaN"]),
            (fb(datums([([5, 6, 263], [6, 7, 8], [1.0] * 3)])), ["vocabulary"]),
            (fb(datums([([5, 6, 7], [6, 7], [1.0] * 3)])), ["2 values for 3 tokens"]),
            (fb(datums([(long, long, [1.0] * len(long))])), ["1194 tokens", "1 to 1024"]),
            (lambda: tc.optim_step(types.AdamParams(learning_rate=1e-3, beta1=1.5)).result(), ["beta1"]),
            (
                lambda: sc.create_lora_training_client(base_model="builtin:other", rank=2).result(),
                ["builtin:other"],
            ),
        ]:
            refused(call, *words)
        sampler = tc.save_weights_and_get_sampling_client().result()
        too_long = types.SamplingParams(max_tokens=2000)
        refused(
            lambda: sampler.sample(types.ModelInput.from_ints([5]), 1, too_long).result(), "max_tokens 2000"
        )
        # the engines run at the smaller of rollout.max_model_len (4096) and the model's own 1024: a
        # prompt past it is refused by that number (one of 600 past 512 reached vLLM and came back raw)
        refused(lambda: sampler.sample(types.ModelInput.from_ints([5] * 1030), 1, types.SamplingParams()).result(),
                "a prompt of 1030 tokens leaves no room in the engines' context of 1024")  # fmt: skip
        state, weights = tc.save_state("own").result().path, tc.save_weights_for_sampler("own").result().path
        with tinker.ServiceClient(base_url=server["url"], api_key="tml-someone-else") as other:
            # another user's two models beside this one, and past serve.max_models (3 here) a fourth is refused
            for _ in range(2):
                other.create_lora_training_client(base_model=base, rank=2).result()
            refused(lambda: sc.create_lora_training_client(base_model=base, rank=2).result(),
                    "3 models are live", "serve.max_models=3")  # fmt: skip
            # what another key saved: not loaded, sampled or listed (the owner's own calls: below)
            refused(lambda: other.create_sampling_client(model_path=weights).result(), "another API key")
            refused(lambda: other.create_training_client_from_state(state).result(), "another API key")
            refused(
                lambda: other.create_rest_client().list_checkpoints(tc.model_id).result(), "another API key"
            )
            intruder = tinker.TrainingClient(
                other.holder, model_seq_id=0, model_id=tc.model_id, info=tc.get_info()
            )
            refused(lambda: intruder.forward(good, "cross_entropy").result(), "another session")
            handle = sampler.get_sampler_handle()
            stolen = tinker.SamplingClient.from_sampler_handle(handle, api_key="tml-someone-else")
            refused(
                lambda: stolen.sample(types.ModelInput.from_ints([5]), 1, too_long).result(),
                "sampling session",
            )
        # ids that order calls and name folders, sent raw: refused before anything is queued (a
        # seq_id "abc" was queued and hung every later call; a model_seq_id of "../" wrote a folder
        # outside the server's)
        import httpx

        def post(route: str, body: dict) -> httpx.Response:
            return httpx.post(
                f"{server['url']}/api/v1/{route}", json=body, headers={"X-API-Key": KEY}, timeout=30
            )

        session = post("create_session", {}).json()["session_id"]
        for route, body, key in [
            ("optim_step", {"model_id": tc.model_id, "seq_id": "abc", "adam_params": {}}, "seq_id"),
            ("optim_step", {"model_id": tc.model_id, "seq_id": -1, "adam_params": {}}, "seq_id"),
            (
                "create_model",
                {
                    "session_id": session,
                    "base_model": base,
                    "model_seq_id": "../../ESCAPED",
                    "lora_config": {"rank": 2},
                },
                "model_seq_id",
            ),  # fmt: skip
        ]:
            answer = post(route, body)
            assert answer.status_code == 400 and key in answer.json()["error"], (route, answer.text)
        assert not list(server["out"].parent.rglob("ESCAPED"))
        # a flood of malformed and hostile requests (tests/tinker_hostile.py), each field of each
        # route in turn: every one refused with a 4xx and one sentence (before: ~60 answered a bare
        # 500 or a dropped connection), nothing written outside <output_dir>/tinker
        outside = files_outside_tinker(server["out"])
        own = json.loads(base64.b64decode(sampler.get_sampler_handle()))["sampling_session_id"]
        with httpx.Client(base_url=server["url"], headers={"X-API-Key": KEY}, timeout=60) as client:
            for name, method, route, sent in hostile_requests(session, tc.model_id, own, state, base):
                answer = client.request(method, route, **sent)
                assert 400 <= answer.status_code < 500, (name, answer.status_code, answer.text[:300])
                assert "\n" not in answer.json()["error"], (name, answer.text)
        assert files_outside_tinker(server["out"]) == outside
        # the model served on, untouched: the same log-probs, and no gradient waiting for a step
        again = tc.forward(good, "cross_entropy").result().loss_fn_outputs
        for a, b in zip(again, first):
            assert a["logprobs"].tolist() == b["logprobs"].tolist()
        assert tc.optim_step(ADAM).result().metrics["grad_norm:mean"] == 0.0
        listed = sc.create_rest_client().list_checkpoints(tc.model_id).result().checkpoints
        assert {c.tinker_path for c in listed} >= {state, weights}
        # strict order, raw: a call sent twice (a retry after a lost answer) is answered under the
        # first one's request id and runs once; a call behind a gap waits for it (5 s here, after
        # which it fails in one sentence, not run), and the missing call arriving later is refused
        sent = tc._request_id_counter  # (the seq_id of the SDK's last call)
        step = {"model_id": tc.model_id, "adam_params": {"learning_rate": 1e-3}}
        twice = [post("optim_step", {**step, "seq_id": sent + 1}).json()["request_id"] for _ in range(2)]
        assert twice[0] == twice[1]
        behind = post("optim_step", {**step, "seq_id": sent + 3}).json()["request_id"]
        answer = post("retrieve_future", {"request_id": behind})
        while answer.status_code == 408:
            answer = post("retrieve_future", {"request_id": behind})
        assert answer.json()["error"] == (
            f"seq_id {sent + 3} of model {tc.model_id} waited 5 s for seq_id {sent + 2}, which never arrived "
            "(serve.order_timeout_s); it was not run"
        )
        late = post("optim_step", {**step, "seq_id": sent + 2})
        assert late.status_code == 400 and "arrived after later calls had run" in late.json()["error"]


def files_outside_tinker(out: Path) -> set[str]:
    """Every file under the server's output folder but its ``tinker`` folder, and every entry beside
    that output folder (a path that escaped would land there)."""
    inside = {str(p.relative_to(out)) for p in out.rglob("*") if not p.relative_to(out).parts[0] == "tinker"}
    return inside | {f"../{p.name}" for p in out.parent.iterdir()}


def kill(class_name: str, alive: int) -> int:
    """SIGKILL the process of one of the server's live actors of ``class_name`` once ``alive`` of
    them are left (the server joined the session's Ray instance, which this process holds)."""
    import signal
    import time

    from ray._private.state import actors

    for _ in range(60):
        pids = [
            a["Pid"] for a in actors().values() if a["ActorClassName"] == class_name and a["State"] == "ALIVE"
        ]
        if len(pids) == alive:
            break
        time.sleep(0.5)
    assert len(pids) == alive, (class_name, pids)
    os.kill(pids[0], signal.SIGKILL)
    return pids[0]


def released(server: dict, models: int) -> None:
    """Wait until the server has released ``models`` models (their sessions ended)."""
    import time

    for _ in range(120):
        if sum(line.rstrip().endswith(" released") for line in server["lines"]) >= models:
            return
        time.sleep(0.25)
    raise AssertionError(f"fewer than {models} models released: " + "".join(server["lines"][-10:]))


def learner_pids(server: dict) -> list[list[int]]:
    """The processes of each model's learners, in the order the models started (the server's line
    for each: learners released by an ended session's model and kept, serve.kept_learners, or new)."""
    said = [re.search(r"trains on the learners of pids ([\d, ]+)$", line.strip()) for line in server["lines"]]
    return [[int(p) for p in m.group(1).split(", ")] for m in said if m]


def forward_logprobs(tc, data) -> list[list[float]]:
    """Each datum's target log-probs under ``tc``'s weights now (a forward)."""
    return [x["logprobs"].tolist() for x in tc.forward(data, "cross_entropy").result().loss_fn_outputs]


def failed_as_the_servers(call, *words: str) -> str:
    with pytest.raises(tinker.RequestFailedError) as caught:
        call()
    assert str(caught.value.category).lower().endswith("server"), str(caught.value)
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))
    return str(caught.value)


def test_a_killed_learner_or_engine_fails_its_call_alone_and_the_model_goes_on(server):
    base, good, seq = server["base"], datums(DATA[:2]), types.ModelInput.from_ints([5, 6, 7, 8, 9, 10])
    with tinker.ServiceClient(base_url=server["url"]) as sc:
        tc = sc.create_lora_training_client(base_model=base, rank=2, seed=3, train_unembed=False).result()
        # a second model like it shares its learners, and trains a step it never saves
        other = sc.create_lora_training_client(base_model=base, rank=2, seed=3, train_unembed=False).result()
        fresh = forward_logprobs(other, good)
        other.forward_backward(good, "cross_entropy").result()
        other.optim_step(ADAM).result()
        tc.forward_backward(good, "cross_entropy").result()
        tc.optim_step(ADAM).result()
        saved = tc.save_state("before-kill").result().path
        kept = forward_logprobs(tc, good)
        tc.forward_backward(good, "cross_entropy").result()
        tc.optim_step(ADAM).result()  # (a step after the save: lost with the learner)
        os.kill(learner_pids(server)[-1][0], signal.SIGKILL)  # (this model's first learner)
        failed_as_the_servers(lambda: tc.forward(good, "cross_entropy").result(), "died", saved, "is lost")
        # the model goes on from its last save: the weights it held then, bit for bit
        again = forward_logprobs(tc, good)
        assert again == kept
        # the other model is told at its next call, and goes on from its base weights
        failed_as_the_servers(lambda: other.forward(good, "cross_entropy").result(), "died",
                              "during another model's call", "did not run", "is lost")  # fmt: skip
        assert forward_logprobs(other, good) == fresh
        sampler = tc.save_weights_and_get_sampling_client().result()
        before = sampler.compute_logprobs(seq).result()
        kill("GeneratorActor", alive=1)
        failed_as_the_servers(lambda: sampler.compute_logprobs(seq).result(), "engines died", "restarted")
        assert sampler.compute_logprobs(seq).result()[1:] == pytest.approx(before[1:], abs=1e-5)


def test_an_rl_loop_a_custom_loss_and_the_exports(server):
    out, base = server["out"], server["base"]
    prompt = [5, 6, 7]
    with tinker.ServiceClient(base_url=server["url"]) as sc:
        tc = sc.create_lora_training_client(base_model=base, rank=4, seed=2, train_unembed=False).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        for step in range(2):  # reward: the share of a sample's tokens below 128; GRPO-style advantages
            drawn = sampler.sample(
                types.ModelInput.from_ints(prompt), 4, types.SamplingParams(max_tokens=4, seed=step)
            )
            sequences = drawn.result().sequences
            rewards = [sum(t < 128 for t in s.tokens) / len(s.tokens) for s in sequences]
            data, inputs = [], []
            for s, r in zip(sequences, rewards):
                tokens, pad = prompt + s.tokens, [0.0] * (len(prompt) - 1)
                given = {
                    "logprobs": pad + s.logprobs,
                    "advantages": pad + [r - sum(rewards) / 4] * len(s.tokens),
                }
                inputs.append({k: torch.tensor(v) for k, v in given.items()})
                data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                        loss_fn_inputs={"target_tokens": tokens[1:], **given}))  # fmt: skip
            loss = "importance_sampling" if step == 0 else "ppo"
            config = None if step == 0 else {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
            fb = tc.forward_backward(data, loss, loss_fn_config=config).result()
            total = 0.0
            for given, o in zip(inputs, fb.loss_fn_outputs):  # each token's loss by hand
                ratio = (o["logprobs"].to_torch() - given["logprobs"]).exp()
                a = given["advantages"]
                want = -ratio * a if step == 0 else -torch.minimum(ratio * a, ratio.clamp(0.9, 1.1) * a)
                assert o["elementwise_loss"].to_torch() == pytest.approx(want, abs=1e-5)
                total += float(want.sum())
            assert fb.metrics["loss:sum"] == pytest.approx(total, abs=1e-4)
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            sampler = tc.save_weights_and_get_sampling_client().result()

        # a custom loss runs on the client and comes back as cross_entropy with its gradient as
        # weights: the same step as cross_entropy itself
        start = tc.save_state("before-custom").result().path

        def custom(data, logprobs):
            loss = sum((-lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs))
            return loss, {"custom": float(loss.detach())}

        tc.forward_backward_custom(datums(DATA), custom).result()
        tc.optim_step(ADAM).result()
        by_custom = state_weights(out, tc.save_state("custom").result().path)
        tc.load_state_with_optimizer(start).result()
        tc.forward_backward(datums(DATA), "cross_entropy").result()
        tc.optim_step(ADAM).result()
        for name, w in state_weights(out, tc.save_state("builtin").result().path).items():
            assert torch.allclose(w, by_custom[name], atol=1e-6), name

        final = tc.save_weights_for_sampler("final").result().path
        seq = [5, 6, 7, 8, 9, 10]
        served = (
            sc.create_sampling_client(model_path=final)
            .result()
            .compute_logprobs(types.ModelInput.from_ints(seq))
            .result()
        )
        rest = tinker.RestClient(base_url=server["url"])
        listed = [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
        assert final in listed and start in listed

    # the final weights: the merged model with transformers, the adapter with peft, and both as served
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = out / "tinker" / final.removeprefix("tinker://")
    merged = AutoModelForCausalLM.from_pretrained(folder / "merged", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), folder / "adapter"
    )
    ids = torch.tensor([seq])
    with torch.no_grad():
        a, b = merged(ids).logits.log_softmax(-1), adapted(ids).logits.log_softmax(-1)
    assert torch.allclose(a, b, atol=1e-5)
    mine = a[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    assert served[1:] == pytest.approx(mine.tolist(), abs=1e-4)


def test_the_example_loop_and_the_cookbooks_recipes_train_back_to_back_on_one_server(server, tmp_path):
    env = {**os.environ, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0", "WANDB_MODE": "disabled",
           "TINKER_BASE_URL": server["url"]}  # fmt: skip
    tiny, long = server["base"], server["long"]

    def run(*cmd: str, cwd: Path = ROOT) -> str:
        done = subprocess.run(
            [sys.executable, *cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, (cmd[:2], done.stdout[-3000:] + done.stderr[-3000:])
        return done.stdout

    def trained(log: Path, steps: int = 2) -> dict:
        """The recipe's final checkpoints (each saved on the server), its steps all logged."""
        rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
        assert {r["step"] for r in rows} >= set(range(steps)), (log.name, rows)
        final = json.loads((log / "checkpoints.jsonl").read_text().splitlines()[-1])
        for path in (final["state_path"], final["sampler_path"]):
            assert (server["out"] / "tinker" / path.removeprefix("tinker://") / "model.json").is_file(), path
        return final

    # the README's own loop (examples/tinker_loop.py): supervised and RL steps, a state, sampler weights
    out = run("examples/tinker_loop.py", f"--base-url={server['url']}", f"--base-model={tiny}", "--steps=1")
    assert "rl step 0: mean reward" in out and "sampler weights: tinker://" in out
    # each recipe unmodified, from its own command line: the model by its folder, an explicit
    # renderer, the fewest steps, no evaluation; the recipes whose default loss is stable_reinforce
    # (math_rl, rubric) with importance_sampling. None closes its session: each model stays live
    # until its heartbeats have stopped 30 s, beside the next recipe's (serve.max_models=3 here)
    small = ["renderer_name=role_colon", "max_steps=2", "eval_every=0", "behavior_if_log_dir_exists=delete"]
    run("-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={tiny}", *small,
        "loss_fn=importance_sampling", "lora_rank=4", "group_size=2", "groups_per_batch=2", "max_tokens=4",
        "save_every=0", f"base_url={server['url']}", f"log_path={tmp_path / 'math_rl'}")  # fmt: skip
    trained(tmp_path / "math_rl")
    conversations = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    run("-m", "tinker_cookbook.recipes.chat_sl.train", f"model_name={tiny}", f"dataset={conversations}", *small,
        "batch_size=4", "lora_rank=4", "max_length=256", "save_every=0", f"log_path={tmp_path / 'chat_sl'}")  # fmt: skip
    trained(tmp_path / "chat_sl")
    run("-m", "tinker_cookbook.recipes.preference.shorter.train", f"model_name={tiny}", *small, "batch_size=2",
        "group_size=2", "max_tokens=8", f"log_path={tmp_path / 'shorter'}")  # fmt: skip
    trained(tmp_path / "shorter")
    run("examples/tinker_dpo.py", f"--base-url={server['url']}", f"--base-model={tiny}",
        f"--log-path={tmp_path / 'dpo'}")  # fmt: skip
    trained(tmp_path / "dpo")
    # the games and the graded answers need a longer context than the tiny model's 1024 (a game's
    # prompt grows with its turns, the grader may write 2048 tokens): the same model with 4096
    run("-m", "tinker_cookbook.recipes.multiplayer_rl.guess_number.train", f"model_name={long}", *small,
        "batch_size=2", "group_size=2", f"log_path={tmp_path / 'guess_number'}")  # fmt: skip
    trained(tmp_path / "guess_number")
    (tmp_path / "tinker_cookbook" / "example_data").mkdir(parents=True)
    run(
        "-m", "tinker_cookbook.recipes.rubric.generate_data", cwd=tmp_path
    )  # (into ./tinker_cookbook/example_data)
    run("-m", "tinker_cookbook.recipes.rubric.train", f"model_name={long}", f"grader_llm_name={long}",
        "grader_renderer_name=role_colon", "loss_fn=importance_sampling", "lora_rank=4", "groups_per_batch=2",
        "train_group_size=2", "save_every=0", f"log_path={tmp_path / 'rubric'}", *small, cwd=tmp_path)  # fmt: skip
    teacher = trained(tmp_path / "rubric")["sampler_path"]
    run("examples/tinker_distill.py", f"--base-url={server['url']}", f"--base-model={long}", f"--teacher={teacher}",
        f"--log-path={tmp_path / 'distill'}")  # fmt: skip
    trained(tmp_path / "distill")
