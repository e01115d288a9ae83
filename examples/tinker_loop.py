"""A training loop written with the Tinker SDK, run against `rltrain serve` (docs/tinker.md):
supervised steps on a few sentences, then RL steps (sample, score, importance sampling), a saved
state and sampler weights that load with transformers and peft.

    rltrain serve --config configs/cpu_tinker.yaml
    TINKER_API_KEY=tml-local python examples/tinker_loop.py --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse

import tinker
from tinker import types

SENTENCES = ["The cat sat on the mat.", "Two plus two is four.", "Paris is the capital of France."]


def supervised_datum(tokenizer, text: str) -> types.Datum:
    """Next-token prediction on every token of ``text``: position i predicts token i + 1."""
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def rl_data(sampler, tokenizer, prompt: str, group: int, seed: int) -> tuple[list[types.Datum], float]:
    """``group`` samples of ``prompt`` scored by how many vowels they hold, as importance-sampling
    datums (advantages: the reward less the group's mean, on the sampled tokens alone)."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=seed)
    sequences = sampler.sample(types.ModelInput.from_ints(ids), group, params).result().sequences
    rewards = [sum(c in "aeiou" for c in tokenizer.decode(s.tokens)) / 8 for s in sequences]
    mean = sum(rewards) / len(rewards)
    data = []
    for s, reward in zip(sequences, rewards):
        tokens, prompt_part = ids + s.tokens, [0.0] * (len(ids) - 1)
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": prompt_part + s.logprobs,
                            "advantages": prompt_part + [reward - mean] * len(s.tokens)},
        ))  # fmt: skip
    return data, mean


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--base-model", default="builtin:tiny")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)

    service = tinker.ServiceClient(base_url=args.base_url)
    trainer = service.create_lora_training_client(base_model=args.base_model, rank=8).result()
    tokenizer = trainer.get_tokenizer()
    adam = types.AdamParams(learning_rate=1e-3)
    for step in range(args.steps):  # supervised: a loss summed over every weighted token
        out = trainer.forward_backward([supervised_datum(tokenizer, t) for t in SENTENCES], "cross_entropy")
        trainer.optim_step(adam).result()
        print(f"supervised step {step}: loss:sum {out.result().metrics['loss:sum']:.3f}")
    for step in range(args.steps):  # RL: sample from the current weights, score, step
        sampler = trainer.save_weights_and_get_sampling_client().result()
        data, reward = rl_data(sampler, tokenizer, "Say something:", group=4, seed=step)
        out = trainer.forward_backward(data, "importance_sampling").result()
        trainer.optim_step(adam).result()
        print(f"rl step {step}: mean reward {reward:.3f}, loss:sum {out.metrics['loss:sum']:.3f}")
    print("state:", trainer.save_state("final").result().path)
    print("sampler weights:", trainer.save_weights_for_sampler("final").result().path)
    service.close("success").result()


if __name__ == "__main__":
    main()
