"""The README's code (and a docs page's): the quick start and the environment as pasted, the reward
function of docs/configuration.md, and the DDP snippet
(examples/ddp_token_mean.py) against the single-process token-mean update."""

import subprocess
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import ddp_token_mean as example  # noqa: E402
from dist_utils import free_port  # noqa: E402


def test_readme_ddp_example_equals_single_process_token_mean():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(example.train_step, args=(2, free_port(), out), nprocs=2, join=True)
        weights = dict(out)

    # reference: one process, every micro-batch of both ranks, (sum of masked squares) / (token count)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = example.micro_batches_of(0) + example.micro_batches_of(1)
    per_token = [model(x).squeeze(-1) ** 2 * mask for x, mask in batches]
    count = sum(mask.sum() for _, mask in batches)
    (sum(t.sum() for t in per_token) / count).backward()
    optimizer.step()

    for rank in (0, 1):
        for ours, ref in zip(weights[rank], model.parameters()):
            torch.testing.assert_close(ours, ref.detach(), rtol=1e-6, atol=1e-7)


def readme_block(section: str, page: str = "README.md") -> str:
    """The first python block under the ``## <section>`` heading of the README (or a docs page)."""
    text = (Path(__file__).resolve().parents[1] / page).read_text()
    return text.split(f"## {section}\n", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_quick_start_runs_as_pasted():
    done = subprocess.run([sys.executable, "-c", readme_block("The loss library in your own loop")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "one optimizer step over 9 loss tokens" in done.stdout  # 3 + 5 tokens, then 1


def test_the_readme_environment_plays_an_episode():
    namespace: dict = {}
    exec(readme_block("An environment in 20 lines"), namespace)
    env = namespace["Countdown"]()
    assert env.reset({"prompt": "Make 7", "answer": "7"}) == [{"role": "user", "content": "Make 7"}]
    wrong = env.step([{"role": "assistant", "content": "6"}])
    right = env.step([{"role": "assistant", "content": " 7 "}])
    assert (wrong.done, right.done, right.reward) == (False, True, 0.5)  # found on the 2nd try: 1/2


def test_the_documented_reward_function_scores_through_its_file(tmp_path):
    from rltrain.rewards.functions import RewardScorer

    (tmp_path / "myreward.py").write_text(readme_block("Reward functions", "docs/configuration.md"))
    with RewardScorer({f"{tmp_path / 'myreward.py'}:brevity": 1.0}, timeout_s=5) as scorer:
        scores = scorer(["so 42", "42", "41"], ["42", "42", "42"])
    assert scores.rewards == [0.5, 1.0, 0.0]  # right in 2 words: 1/2; alone: 1; wrong: 0
