"""Log-probs from hidden states (rltrain.forward.head.head_forward / head_logprobs_and_entropy): the
model stops at its last hidden states and the head runs chunk by chunk, recomputed in the backward.
Values, entropies and every parameter's gradient equal the full-logits path's to fp32 rounding,
padded and packed, with temperature, the engine's truncation, a tied head, a biased head and LoRA on
the head; models whose logits are more than the head's output keep the logits path."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Gemma2Config, Qwen2Config

from rltrain.forward import head_forward, padded_forward, sequence_logprobs
from rltrain.loss.logprobs import Truncation, head_logprobs_and_entropy

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def tiny_lm(tied: bool = False, vocab: int = 97) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)  # fmt: skip
    return AutoModelForCausalLM.from_config(config).float()


def forward_of(model, ids: torch.Tensor):
    """The model's padded forward on unpadded rows, as head_forward calls it."""
    return lambda **extra: padded_forward(model, ids, torch.ones_like(ids), **extra)


def batch(vocab: int = 97) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left-padded prompt
    mask[1, 9:] = 0  # right-padded completion
    return ids, mask


def both_paths(model, packed: bool, temperature: float, truncation: Truncation | None):
    """(log-probs, entropy, every parameter's gradient) from hidden states and from full logits."""
    ids, mask = batch(model.config.vocab_size)
    g = torch.Generator().manual_seed(2)
    weights = torch.randn(ids.shape, generator=g)  # an arbitrary upstream gradient per token
    results = []
    for from_hidden in (True, False):
        model.zero_grad()
        logprobs, entropy = sequence_logprobs(
            model, ids, mask, temperature, True, packed, truncation, from_hidden
        )
        (logprobs * weights * mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logprobs.detach(), entropy, grads))
    return results


CASES = {
    "padded": (False, 1.0, None),
    "packed, temperature 0.7": (True, 0.7, None),
    "padded, top-k 5 and top-p 0.9": (False, 1.0, Truncation(top_k=5, top_p=0.9)),
    "packed, min-p 0.05 at 1.3": (True, 1.3, Truncation(min_p=0.05)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("tied", [False, True], ids=["own head", "tied head"])
def test_log_probs_from_hidden_states_equal_the_full_logits_path_in_value_and_gradient(case, tied):
    model = tiny_lm(tied)
    (hidden, h_entropy, h_grads), (full, f_entropy, f_grads) = both_paths(model, *CASES[case])
    assert torch.isfinite(hidden).all() and (hidden <= 0).all()
    torch.testing.assert_close(hidden, full, rtol=0, atol=1e-5)
    torch.testing.assert_close(h_entropy, f_entropy, rtol=0, atol=1e-5)
    assert h_grads.keys() == f_grads.keys() and "model.embed_tokens.weight" in h_grads
    for name in f_grads:  # the head's weight included (tied: its gradient is the embedding's too)
        scale = f_grads[name].abs().max().clamp(min=1e-12)
        assert (h_grads[name] - f_grads[name]).abs().max() / scale < 1e-5, name


def test_lora_on_the_head_trains_its_adapters_as_the_full_logits_path_does():
    model = get_peft_model(tiny_lm(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]))
    with torch.no_grad():  # B starts at 0: move it so that the head's adapter changes the logits
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    states, head = head_forward(model, forward_of(model, batch()[0]))
    assert head is not None and states.shape[-1] == 32 and "lora" in type(head).__module__
    (hidden, _, h_grads), (full, _, f_grads) = both_paths(model, False, 1.0, None)
    torch.testing.assert_close(hidden, full, rtol=0, atol=1e-5)
    assert any("lm_head.lora_A" in n for n in h_grads)  # the head's adapter gets its gradient
    for name in f_grads:
        scale = f_grads[name].abs().max().clamp(min=1e-12)
        assert (h_grads[name] - f_grads[name]).abs().max() / scale < 1e-5, name
    with model.disable_adapter():  # the reference: the same model with its adapters off
        off, _ = sequence_logprobs(model, *batch())
        plain, _ = sequence_logprobs(model, *batch(), from_hidden=False)
    torch.testing.assert_close(off, plain, rtol=0, atol=1e-5)
    assert (off - hidden).abs().max() > 1e-3  # the adapters did change them


def test_chunks_of_a_few_tokens_give_the_one_chunk_values_and_gradients():
    # 3 x 11 tokens in chunks of 4 rows: 9 chunks (8 of 4 tokens, 1 of 1)
    torch.manual_seed(3)
    head = torch.nn.Linear(16, 97, bias=True)  # a biased head: its bias gets its gradient too
    hidden = torch.randn(3, 11, 16, requires_grad=True)
    ids = torch.randint(0, 97, (3, 11))
    out = {}
    for name, rows in {"chunked": 4, "whole": None}.items():
        head.zero_grad()
        hidden.grad = None
        logprobs, entropy = head_logprobs_and_entropy(head, hidden, ids, 0.8, chunk_rows=rows)
        logprobs.square().sum().backward()
        out[name] = (logprobs, entropy, hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone())
    for got, want in zip(out["chunked"], out["whole"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # summed in another order
    with torch.no_grad():  # and the plain log-softmax of the logits
        want = torch.log_softmax(head(hidden) / 0.8, -1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(out["chunked"][0].detach(), want, rtol=0, atol=1e-5)


def test_a_soft_capped_head_runs_on_the_hidden_state_path_as_its_full_logits():
    # Gemma 2 soft-caps its logits (tanh(logits / 30) * 30; 0.5 here, so the cap bends them): the
    # soft-cap is folded into the head the chunks run, and the log-probs and every gradient are the
    # full-logits path's (an unknown transform keeps that path: tests/test_families.py)
    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                          final_logit_softcapping=0.5)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    ids = torch.randint(0, 64, (2, 5))
    states, head = head_forward(model, forward_of(model, ids))
    assert head is not None and head.transform.softcap == 0.5 and states.shape == (2, 5, 32)
    mask = torch.ones_like(ids)
    results = []
    for from_hidden in (True, False):
        model.zero_grad()
        logprobs, _ = sequence_logprobs(model, ids, mask, from_hidden=from_hidden)
        logprobs.sum().backward()
        results.append(
            (
                logprobs.detach(),
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            )
        )
    (hidden, hidden_grads), (full, full_grads) = results
    torch.testing.assert_close(hidden, full, rtol=0, atol=1e-5)
    for name, grad in full_grads.items():
        torch.testing.assert_close(hidden_grads[name], grad, rtol=1e-5, atol=1e-7)
    # the cap bends these logits: the head's own output differs from the model's logits
    raw = model.get_output_embeddings()(states)
    assert (torch.tanh(raw / 0.5) * 0.5 - raw).abs().max() > 1e-3
