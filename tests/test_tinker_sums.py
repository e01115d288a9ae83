"""The Tinker API's losses as token sums (rltrain.loss.sums), and what the server checks before
its learners see a request (rltrain.serve: sampling settings, checkpoint paths, model records):
pure functions, by hand."""

import math

import pytest
import torch

from rltrain.loss import sums
from rltrain.serve.wire import BadRequest

LP = torch.tensor([[-1.0, -2.0, -0.5]])  # the model's log-probs of 3 targets
MASK = torch.tensor([[1.0, 1.0, 0.0]])  # the third cell is padding


def losses(loss_fn, inputs, config=None, lp=LP):
    return sums.token_losses(loss_fn, lp, {**inputs, "mask": MASK}, sums.settings(loss_fn, config))


def test_cross_entropy_is_the_weighted_sum_of_negative_log_probs():
    out = losses("cross_entropy", {"weights": torch.tensor([[2.0, 0.5, 9.0]])})
    # -(2 * -1), -(0.5 * -2), padding 0: sum 2 + 1 = 3 (no mean over the 2 tokens)
    assert out.tolist() == [[2.0, 1.0, 0.0]]
    assert float(out.sum()) == 3.0


def test_importance_sampling_ppo_cispo_and_dro_by_hand():
    sampled = torch.tensor([[-1.0, -2.0 + math.log(2.0), 0.0]])  # ratios exp(0) = 1, exp(-log 2) = 0.5
    adv = torch.tensor([[1.0, -2.0, 5.0]])
    inputs = {"logprobs": sampled, "advantages": adv}
    # importance sampling: -r * A = -1 * 1, -0.5 * -2 = 1
    assert losses("importance_sampling", inputs)[0].tolist() == pytest.approx([-1.0, 1.0, 0.0])
    # ppo, clip [0.8, 1.2]: token 2 has r = 0.5, clipped 0.8; A = -2: min(0.5 * -2, 0.8 * -2) = -1.6 -> 1.6
    assert losses("ppo", inputs)[0].tolist() == pytest.approx([-1.0, 1.6, 0.0])
    # with clip_low_threshold 0.4 the ratio 0.5 stays: min(-1, -1) -> 1
    assert losses("ppo", inputs, {"clip_low_threshold": 0.4})[0].tolist() == pytest.approx([-1.0, 1.0, 0.0])
    # cispo, clip [0.6, 1.5]: -clip(r) * lp * A = -(1 * -1 * 1) = 1, -(0.6 * -2 * -2) = -2.4
    cispo = {"clip_low_threshold": 0.6, "clip_high_threshold": 1.5}
    assert losses("cispo", inputs, cispo)[0].tolist() == pytest.approx([1.0, -2.4, 0.0])
    # dro, beta 2: -(lp * A - 1 * (lp - sampled)^2) = -(-1 - 0) = 1 ; -(4 - (log 2)^2)
    out = losses("dro", inputs, {"beta": 2.0})
    assert out[0].tolist() == pytest.approx([1.0, -(4.0 - math.log(2.0) ** 2), 0.0])


def test_cispo_takes_no_gradient_through_its_clipped_ratio():
    lp = LP.clone().requires_grad_()
    sampled = torch.tensor([[-1.5, -2.0, 0.0]])  # r = exp(0.5) = 1.65 on token 1: clipped to 1.5
    inputs = {"logprobs": sampled, "advantages": torch.ones(1, 3)}
    cispo = {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}
    losses("cispo", inputs, cispo, lp).sum().backward()
    # d/dlp of -stopgrad(clip(r)) * lp * A = -clip(r): -1.5 and -1 (r = 1), padding 0
    assert lp.grad[0].tolist() == pytest.approx([-1.5, -1.0, 0.0])


def test_settings_refuse_what_is_not_served_and_guess_no_default():
    with pytest.raises(
        ValueError, match="stable_reinforce'.* but not its objective, so it is not served.*served: "
    ):
        sums.settings("stable_reinforce", {})
    with pytest.raises(ValueError, match="clip_ratio"):
        sums.settings("ppo", {"clip_ratio": 0.2})
    with pytest.raises(ValueError, match="clip_low_threshold"):
        sums.settings("cispo", {"clip_high_threshold": 1.2})
    with pytest.raises(ValueError, match="beta"):
        sums.settings("dro", {})
    with pytest.raises(ValueError, match="not a number"):
        sums.settings("ppo", {"clip_low_threshold": "low"})
    assert sums.settings("ppo", {}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    # thresholds a datum gives token by token need no setting
    assert sums.settings("cispo", {}, {"clip_low_threshold", "clip_high_threshold"}) == {}


def test_sample_calls_are_checked_before_any_engine_sees_them():
    from rltrain.serve.sampling import sample_call

    def call(params=None, tokens=(1, 2, 3), **extra):
        body = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": list(tokens)}]},
                "sampling_params": params or {}, **extra}  # fmt: skip
        return sample_call(body, vocab=100, context=10)

    c = call({"max_tokens": 4, "seed": 3, "stop": ["\n"], "top_k": 5}, num_samples=2)
    assert (c.prompt, c.num_samples) == ([1, 2, 3], 2)
    assert c.sampling == {
        "max_tokens": 4,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 5,
        "seed": 3,
        "stop": ["\n"],
    }
    assert call().sampling["max_tokens"] == 7  # no max_tokens: what the context of 10 leaves after 3
    assert call({"stop": [7, 8]}).sampling["stop_token_ids"] == [7, 8]
    assert call({"stop": []}).sampling["ignore_eos"] is True  # [] stops at nothing, EOS included
    for params, extra, words in [
        ({"max_tokens": 8}, {}, "max_tokens 8"),  # 3 + 8 > 10
        ({}, {"num_samples": 0}, "num_samples"),
        ({"top_p": 0.0}, {}, "top_p"),
        ({"top_k": 0}, {}, "top_k"),
        ({"temperature": -1}, {}, "temperature"),
        ({"stop": [100]}, {}, "stop token ids"),
        ({}, {"topk_prompt_logprobs": 3}, "top-k prompt log-probs"),
        ({}, {"record_stability_info": True}, "stable_reinforce"),
    ]:
        with pytest.raises(BadRequest, match=words):
            call(params, **extra)
    with pytest.raises(BadRequest, match="vocabulary"):
        call(tokens=(1, 100))
    with pytest.raises(
        BadRequest, match="a prompt of 10 tokens leaves no room in the engines' context of 10"
    ):
        call(tokens=range(10))


def test_a_base_models_engines_run_at_the_smaller_of_the_configured_and_its_own_context(tiny_model_path):
    # vLLM refuses a max_model_len past the model's position embeddings: a model of 1024 positions on
    # a server configured for 4096 gets engines of 1024 (and sampling is checked against the same
    # number); one configured for 512 keeps 512 (a prompt past it is refused, not sent)
    from rltrain.config import load_config
    from rltrain.serve.models import engine_context, model_record, served_config

    record = model_record({"base_model": "b", "lora_config": {"rank": 2}})
    for configured, own, expected in [(4096, 1024, 1024), (512, 1024, 512), (512, 40, 40)]:
        config = load_config("configs/cpu_tinker.yaml", [f"rollout.max_model_len={configured}"])
        assert engine_context(config, own) == expected
        served = served_config(config, tiny_model_path, record, own)
        assert served.rollout.max_model_len == expected
        assert served.max_prompt_tokens + served.rollout.max_new_tokens <= expected


def test_checkpoint_paths_resolve_only_to_what_was_saved(tmp_path):
    from rltrain.serve.checkpoints import Checkpoints, key_owner

    store, mine, theirs = Checkpoints(tmp_path), key_owner("tml-mine"), key_owner("tml-theirs")
    record = {"base_model": "b", "owner": mine}
    folder, path = store.new("s:train:0", "weights", "step-1", record)
    assert path == "tinker://s:train:0/weights/step-1" and folder.is_dir()
    assert store.resolve(path, "weights", mine) == (folder, record)
    assert "tml-mine" not in (folder / "model.json").read_text()  # (a hash of the key, never the key)
    with pytest.raises(BadRequest, match="belongs to another API key"):
        store.resolve(path, "weights", theirs)
    with pytest.raises(BadRequest, match="belong to another API key"):
        store.listed("s:train:0", theirs)
    for bad, words in [
        ("tinker://s:train:0/weights/other", "nothing was saved"),
        ("tinker://../weights/step-1", "nothing was saved"),
        ("file:///etc/passwd", "no tinker://"),
        ("tinker://s:train:0/weights/../x", "no tinker://"),
    ]:
        with pytest.raises(BadRequest, match=words):
            store.resolve(bad, "weights", mine)
    with pytest.raises(BadRequest, match="this call takes"):
        store.resolve(path, "sampler_weights", mine)
    with pytest.raises(BadRequest, match="overwrite"):
        store.new("s:train:0", "weights", "step-1", {}, overwrite=False)
    with pytest.raises(BadRequest, match="checkpoint name"):
        store.new("s:train:0", "weights", "../up", {})
    assert [c["tinker_path"] for c in store.listed("s:train:0", mine)] == [path]
    with pytest.raises(BadRequest, match="no model"):
        store.listed("..", mine)


def test_a_model_record_refuses_what_is_not_served():
    from rltrain.serve.models import model_record

    record = model_record({"base_model": "b", "lora_config": {"rank": 4, "seed": 1, "train_unembed": False}})
    assert record["lora_config"] == {"rank": 4, "seed": 1, "train_attn": True, "train_mlp": True,
                                     "train_unembed": False}  # fmt: skip
    for body, words in [
        ({"lora_config": {"rank": 0}}, "rank of 1 or more"),
        ({"lora_config": {"rank": 4, "dropout": 0.1}}, "dropout"),
        ({"lora_config": {"rank": 4}, "optimizer_config": {"type": "sgd"}}, "sgd"),
        (
            {"lora_config": {"rank": 4, "train_attn": False, "train_mlp": False, "train_unembed": False}},
            "nothing",
        ),
    ]:
        with pytest.raises(BadRequest, match=words):
            model_record(body)


def test_lora_targets_are_each_familys_own_linear_layers_and_alpha_is_tinkers(tmp_path, tiny_model_path):
    # train_attn / train_mlp / train_unembed read on the model at hand (built on the meta device):
    # fused projections by their own names, a name both kinds use by its parent (GPT-2's c_proj),
    # a hybrid's token mixer as attention, routers never; experts held as one tensor are refused
    import families
    from transformers import GPT2Config

    from rltrain.config import load_config
    from rltrain.models.adapters import lora_targets
    from rltrain.serve.models import TINKER_ALPHA, lora_modules, model_record, served_config, takes_adapters

    def targets(model, *asked):
        return lora_targets(model, *asked)

    with torch.device("meta"):
        cases = {
            name: families.build(name) for name in ("qwen2", "phi3", "bloom", "granite4-hybrid", "qwen2_moe")
        }
        gpt2 = __import__("transformers").GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2))
    assert targets(cases["qwen2"], True, True, False) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"]  # fmt: skip
    assert targets(cases["phi3"], True, False, False) == ["o_proj", "qkv_proj"]
    assert targets(cases["phi3"], False, True, False) == ["gate_up_proj", "down_proj"]
    assert targets(cases["bloom"], True, False, True) == ["query_key_value", "dense", "lm_head"]
    assert targets(gpt2, True, False, False) == ["c_attn", "attn.c_proj"]
    assert targets(gpt2, False, True, False) == ["c_fc", "mlp.c_proj"]
    assert targets(gpt2, True, True, False) == ["c_attn", "c_proj", "c_fc"]
    assert {"in_proj", "out_proj"} <= set(targets(cases["granite4-hybrid"], True, False, False))
    moe = targets(cases["qwen2_moe"], False, True, False)
    assert "gate" not in moe and "shared_expert_gate" not in moe
    # served: the family's own names, Tinker's alpha; fused experts refused in one line
    config = load_config("configs/cpu_tinker.yaml")
    served = served_config(
        config, tiny_model_path, model_record({"base_model": "b", "lora_config": {"rank": 4}}), 1024
    )
    assert served.model.lora.alpha == TINKER_ALPHA == 32.0 and not takes_adapters(served)
    assert served.model.lora.target_modules[-1] == "lm_head"
    families.build("gpt-oss").config.save_pretrained(tmp_path / "gpt-oss")
    with pytest.raises(BadRequest, match="experts are held as one tensor each"):
        lora_modules(
            str(tmp_path / "gpt-oss"), False, {"train_attn": True, "train_mlp": True, "train_unembed": False}
        )
    assert lora_modules(str(tmp_path / "gpt-oss"), False, {"train_attn": True, "train_mlp": False,
                                                          "train_unembed": False}) == ["q_proj", "k_proj", "v_proj", "o_proj"]  # fmt: skip
