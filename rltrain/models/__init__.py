"""What a model is: the built-in tiny models (:mod:`~rltrain.models.tiny`), pretrained checkpoints
(:mod:`~rltrain.models.pretrained`, GGUF files), LoRA adapters (:mod:`~rltrain.models.adapters`),
a mixture of experts' router hooks and routing replay (:mod:`~rltrain.models.routers`), and the
model folder a run resolves and checks before it starts (:mod:`~rltrain.models.resolve`).

It hands on model folders, tokenizers and hooks; it knows nothing of rollouts, learners or runs.
"""
