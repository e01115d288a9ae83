"""Tool calls through the real generation backends.

A random tiny model never writes a tool call, so this test first teaches it one, with rltrain's own
token-level SFT loss: on the question below it learns to answer
``<tool:calculator>6*7</tool>``, then, after the tool's ``<result>42</result>``, ``The answer is 42.``
Generation then has to stop at ``</tool>``, run the calculator, append its output with tool mask 0
and continue.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rltrain.config import Config, DataConfig, RolloutConfig
from rltrain.data import arithmetic_rows, tokenize_prompts
from rltrain.losses import sft_cross_entropy
from rltrain.rollout import GeneratorActor, VLLMBackend

pytestmark = pytest.mark.slow
CALL, RESULT, ANSWER = "<tool:calculator>6*7</tool>", "<result>42</result>", "The answer is 42.<|im_end|>"


@pytest.fixture(scope="module")
def tool_model(tiny_model_path, tmp_path_factory):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    (question,) = tokenize_prompts([{"prompt": "What is 6 * 7?", "answer": "42"}], tokenizer, DataConfig())
    prompt = question.token_ids
    completion = tokenizer.encode(CALL + RESULT + ANSWER, add_special_tokens=False)
    ids = torch.tensor([prompt + completion])
    mask = torch.zeros_like(ids)
    mask[0, len(prompt) :] = 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for step in range(2000):
        logits = model(input_ids=ids).logits
        loss = sft_cross_entropy(logits[:, :-1], ids[:, 1:], mask[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        # done when every completion token is the model's first choice (greedy decoding reproduces it)
        if step % 50 == 49 and bool(
            (model(input_ids=ids).logits.argmax(-1)[:, :-1] == ids[:, 1:])[mask[:, 1:] == 1].all()
        ):
            break
    else:
        pytest.fail("the tiny model did not learn the tool-call completion")
    out = tmp_path_factory.mktemp("tool_model")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out), prompt, tokenizer


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_tool_call_runs_and_its_output_is_masked(backend, tool_model):
    path, prompt, tokenizer = tool_model
    config = Config.model_validate({"rollout": {
        "backend": backend, "max_new_tokens": 64, "temperature": 0.05, "tools": {"enabled": ["calculator"]}}})  # fmt: skip
    actor = GeneratorActor(config, path, engine_index=0)
    (completion,) = actor.rollout([prompt], seeds=[0])
    if backend == "vllm":
        del actor  # free the engine's KV cache before the next case

    assert completion.tool_calls == 1 and completion.tool_errors == 0
    assert completion.text.startswith(CALL + RESULT + "The answer is 42.")
    # tool mask: 1 on the call and the answer (the policy's tokens), 0 exactly on the tool's result
    n_call = len(tokenizer.encode(CALL, add_special_tokens=False))
    n_result = len(tokenizer.encode(RESULT, add_special_tokens=False))
    assert completion.tool_mask[:n_call] == [1] * n_call
    assert completion.tool_mask[n_call : n_call + n_result] == [0] * n_result
    assert all(completion.tool_mask[n_call + n_result :])
    assert tokenizer.decode(completion.token_ids[n_call : n_call + n_result]) == RESULT
    # generator log-probs: 0 on tool tokens (no sampling happened there); on policy tokens at
    # temperature 0.05 a memorized token's log-prob may round to 0 too
    assert all(lp == 0.0 for lp in completion.logprobs[n_call : n_call + n_result])
    assert all(lp <= 0.0 for lp in completion.logprobs) and len(completion.logprobs) == len(
        completion.token_ids
    )


def test_vllm_batch_of_seeded_requests_larger_than_one_engine_step(tiny_model_path):
    """64 seeded prompts of 100 tokens (6400 tokens) outgrow vLLM's default 2048-token step. With the
    prompt split over steps, vLLM on CPU rewinds each request's sampling generator and fails ("CPU
    Generator does not use offset"); whole prefills keep sampling going, and seeded as before: the
    same seed gives the same tokens whatever else is in the batch."""
    backend = VLLMBackend(tiny_model_path, RolloutConfig(max_model_len=512), stop=[], seed=0)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 200, (64, 100), generator=generator).tolist()
    segments = backend.generate(prompts, [8] * 64, seeds=list(range(64)))
    assert len(segments) == 64 and all(1 <= len(s.token_ids) <= 8 for s in segments)
    (alone,) = backend.generate(prompts[5:6], [8], seeds=[5])
    assert alone.token_ids == segments[5].token_ids
    del backend


def test_vllm_text_decoded_once_equals_its_incremental_detokenization(tiny_model_path):
    """Without stop strings the completion is decoded once after generation, not token by token by
    vLLM; same seeds, same tokens: the text, the tokens and their log-probs are what vLLM's own
    detokenizing path gives (the random byte-level model writes invalid UTF-8 too, also at the end)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    prompts = [p.token_ids for p in tokenize_prompts(arithmetic_rows(16), tokenizer, DataConfig())]
    backend = VLLMBackend(tiny_model_path, RolloutConfig(max_model_len=512), stop=["<never written>"], seed=0)
    incremental = backend.generate(prompts, [24] * 16, seeds=list(range(16)))
    backend.stop = []  # as for a run without tools
    decoded_once = backend.generate(prompts, [24] * 16, seeds=list(range(16)))
    del backend
    assert [s.token_ids for s in decoded_once] == [s.token_ids for s in incremental]
    assert [s.logprobs for s in decoded_once] == [s.logprobs for s in incremental]
    assert [s.text for s in decoded_once] == [s.text for s in incremental]
    assert sum(len(s.text) for s in incremental) > 100
