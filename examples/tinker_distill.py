"""On-policy distillation through tinker-cookbook's own trainer
(`tinker_cookbook.distillation.train_on_policy.main`, unmodified) against `rltrain serve`: a
student samples answers to local prompts and is trained towards a teacher's log-probs on them, the
teacher loaded from sampler weights saved on the server (a `tinker://` path):

    python examples/tinker_distill.py --base-url http://127.0.0.1:8000 --base-model builtin:tiny \\
        --teacher tinker://<model_id>/sampler_weights/<name> --log-path runs/tinker_distill

``--prompts`` takes a text file of one prompt per line (a few made-up ones otherwise).
"""

import argparse
import asyncio
from pathlib import Path

import chz
from tinker_cookbook.distillation.datasets import PromptOnlyDataset
from tinker_cookbook.rl.types import RLDatasetBuilder

PROMPTS = ["What is 3+4?", "Name a planet.", "Write a short greeting.", "What colour is grass?",
           "Count from one to five.", "What is the opposite of hot?"]  # fmt: skip


@chz.chz
class LocalPrompts(RLDatasetBuilder):
    """Prompts from a list, as the recipe's own builder serves DeepMath's or Tulu 3's."""

    prompts: tuple[str, ...]
    groups_per_batch: int
    group_size: int
    model_name_for_tokenizer: str
    renderer_name: str

    async def __call__(self):
        from tinker_cookbook import renderers
        from tinker_cookbook.tokenizer_utils import get_tokenizer

        tokenizer = get_tokenizer(self.model_name_for_tokenizer)
        renderer = renderers.get_renderer(self.renderer_name, tokenizer=tokenizer)
        return PromptOnlyDataset(
            list(self.prompts), self.groups_per_batch, self.group_size, renderer, tokenizer
        ), None


def main() -> None:
    from tinker_cookbook.distillation import train_on_policy
    from tinker_cookbook.distillation.datasets import DistillationDatasetConfig, TeacherConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--base-model", default="builtin:tiny")
    parser.add_argument("--teacher", required=True, help="tinker:// path of the teacher's sampler weights")
    parser.add_argument("--prompts", type=Path, help="one prompt per line")
    parser.add_argument("--renderer", default="role_colon")
    parser.add_argument("--log-path", type=Path, default=Path("runs/tinker_distill"))
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    prompts = args.prompts.read_text().splitlines() if args.prompts else PROMPTS
    dataset = LocalPrompts(prompts=tuple(p for p in prompts if p.strip()), groups_per_batch=2, group_size=2,
                           model_name_for_tokenizer=args.base_model, renderer_name=args.renderer)  # fmt: skip
    teacher = TeacherConfig(base_model=args.base_model, load_checkpoint_path=args.teacher)
    config = train_on_policy.Config(
        learning_rate=1e-4, model_name=args.base_model, recipe_name="on_policy_distillation",
        renderer_name=args.renderer, max_tokens=16, lora_rank=4, log_path=str(args.log_path),
        base_url=args.base_url, eval_every=0, save_every=0, max_steps=args.steps,
        dataset_configs=[DistillationDatasetConfig(dataset_builder=dataset, teacher_config=teacher, groups_per_batch=2)],
    )  # fmt: skip
    asyncio.run(train_on_policy.main(config))


if __name__ == "__main__":
    main()
