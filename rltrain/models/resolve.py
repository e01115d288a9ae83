"""The model a run trains, resolved and checked before anything starts: the built-in tiny models
built into the run folder, a GGUF file converted once, or a folder or hub name whose transformers
config is read (no weights); its tokenizer; the frozen models that must share it (the teacher, the
reward model) and the judge; and what the model allows (sequence parallelism's heads, LoRA on
experts, routing replay). Each problem raises one :class:`~rltrain.config.ConfigError` line.
"""

from __future__ import annotations

from pathlib import Path

from rltrain.config import BUILTIN_MODELS, Config, ConfigError, first_line
from rltrain.models import families
from rltrain.models.pretrained import model_folder


def resolve_model(config: Config, out: Path) -> str:
    """The folder of ``model.name_or_path``: a built-in model built under ``out``, a GGUF file's
    conversion, or the folder or hub name as given."""
    if config.model.name_or_path in BUILTIN_MODELS:
        from rltrain.models.tiny import build_tiny_model

        family = BUILTIN_MODELS[config.model.name_or_path]
        folder = {"qwen2": "tiny_model", "qwen3_moe": "tiny_moe_model"}.get(family, f"tiny_{family}_model")
        return str(build_tiny_model(out / folder, seed=config.run.seed, family=family).resolve())
    try:
        return model_folder(config.model.name_or_path)
    except (ImportError, OSError, ValueError) as e:  # a .gguf that does not convert
        raise ConfigError(f"model.name_or_path: {config.model.name_or_path!r} does not load: {e}") from None


def model_config(config: Config, key: str, model_path: str):
    """The transformers config of a local model folder or hub name (``key`` names it in errors),
    whose context must hold the longest sequence."""
    folder = Path(model_path).expanduser()
    local = folder.is_dir()
    if local and not (folder / "config.json").is_file():
        raise ConfigError(f"{key}: {model_path!r} has no config.json (not a transformers model folder)")
    from transformers import AutoConfig

    try:  # a hub name: its config.json alone is fetched (and cached) now
        model_config = AutoConfig.from_pretrained(
            folder if local else model_path, trust_remote_code=config.model.trust_remote_code
        )
    except Exception as e:
        if local:
            raise ConfigError(f"{key}: cannot read {str(folder / 'config.json')!r} ({e})") from None
        raise ConfigError(
            f"{key}: {model_path!r} is no local model folder and cannot be loaded from the hub ({first_line(e)})"
        ) from None
    context = getattr(model_config, "max_position_embeddings", None)
    if context is not None and config.longest_sequence > context:
        raise ConfigError(
            f"data.max_prompt_tokens + rollout.max_new_tokens = {config.longest_sequence} exceeds the "
            f"context of {context} tokens of {key} (max_position_embeddings in {model_path})"
        )
    return model_config


def load_tokenizer(config: Config, key: str, model_path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path, trust_remote_code=config.model.trust_remote_code)
    except Exception as e:  # a model folder without tokenizer files, say
        raise ConfigError(f"{key}: cannot load the tokenizer of {model_path!r} ({first_line(e)})") from None


def check_scoring_models(config: Config, tokenizer) -> None:
    """The teacher and the reward model score the policy's token ids as sampled: each must share
    its tokenizer; the reward model must be a one-label sequence classifier with a chat template."""
    judge = config.reward.judge
    if (
        judge is not None and judge.model is not None
    ):  # a judge reads text: any tokenizer with a chat template
        model_config(config, "reward.judge.model", judge.model)
        if load_tokenizer(config, "reward.judge.model", judge.model).chat_template is None:
            raise ConfigError(
                f"reward.judge.model: {judge.model!r} has no chat template to put the question in"
            )
    models = {"algorithm.teacher": config.algorithm.teacher, "reward.model": config.reward.model}
    for key, path in models.items():
        if path is None:
            continue
        architecture = model_config(config, key, path)
        check_layout(config, {"algorithm.teacher": "algorithm.teacher_learners"}.get(key, "reward.model_learners"),
                     path, architecture)  # fmt: skip
        theirs = load_tokenizer(config, key, path)
        if theirs.get_vocab() != tokenizer.get_vocab():
            raise ConfigError(
                f"{key}: the tokenizer of {path!r} differs from the policy's ({len(theirs)} vs "
                f"{len(tokenizer)} tokens, or other ids); it must score the policy's token ids as sampled"
            )
        if key != "reward.model":
            continue
        architectures = getattr(architecture, "architectures", None) or []
        if not any(a.endswith("ForSequenceClassification") for a in architectures):
            raise ConfigError(
                f"reward.model: {path!r} is {', '.join(architectures) or 'no known architecture'}, "
                "expected a sequence-classification model (one score per sequence)"
            )
        if architecture.num_labels != 1:
            raise ConfigError(
                f"reward.model: {path!r} has {architecture.num_labels} labels, expected 1 (a score)"
            )
        if theirs.chat_template is None:
            raise ConfigError(
                f"reward.model: {path!r} has no chat template (it scores the prompt's chat rendering)"
            )


def meta_model(config: Config, architecture):
    """The model of ``architecture`` on the meta device (no weights, no compute): what its layers
    are made of (:func:`rltrain.models.families.needs`)."""
    import torch

    with torch.device("meta"):
        return families.causal_lm_class(architecture).from_config(
            architecture, trust_remote_code=config.model.trust_remote_code
        )


def check_layout(config: Config, key: str, model_path: str, architecture, model=None):
    """The learners of config section ``key`` can run the model exactly in their layout
    (:func:`rltrain.models.families.layout_problem`), or the run stops in one line naming why;
    returns the model's :class:`~rltrain.models.families.ModelNeeds`. ``model``: the architecture's
    meta model where one is built already."""
    section = config
    for part in key.split("."):
        section = getattr(section, part)
    model_needs = families.needs(
        architecture, model if model is not None else meta_model(config, architecture)
    )
    sp = getattr(section, "sequence_parallel_size", 1)
    if problem := families.layout_problem(model_needs, key, section.packing, section.prefix_sharing, sp):
        raise ConfigError(f"{key}: {model_path}: {problem}")
    return model_needs


def check_model(config: Config, model_path: str) -> None:
    """A local model folder must be a transformers model whose context holds the longest sequence,
    and one the learners can run in their layout (the critic's too, where it starts from it)."""
    architecture = model_config(config, "model.name_or_path", model_path)
    model = meta_model(config, architecture)
    model_needs = check_layout(config, "learner", model_path, architecture, model)
    if config.algorithm.advantage == "gae":
        critic = config.critic.model or model_path
        check_layout(config, "critic.learners", critic, model_config(config, "critic.model", critic))
    sp = config.learner.sequence_parallel_size
    if sp > 1 and architecture.num_attention_heads % sp:
        raise ConfigError(
            f"learner.sequence_parallel_size={sp} does not divide the model's "
            f"{architecture.num_attention_heads} attention heads"
        )
    from rltrain.models.routers import config_experts

    experts = config_experts(architecture) > 0
    if experts and config.model.lora.rank and config.rollout.backend == "vllm":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "model.lora.rank with a mixture of experts: vLLM's CPU engine cannot serve LoRA adapters "
                "on expert layers (its fused-MoE LoRA kernel needs Triton); train every weight "
                "(model.lora.rank=0) or generate with rollout.backend=hf"
            )
    gated_delta = "torch_chunk_gated_delta_rule" in model_needs.state_functions
    if config.rollout.backend == "vllm" and gated_delta:
        import torch

        if not torch.cuda.is_available():  # (its CPU kernel asserts bf16, at any head size but 64+)
            raise ConfigError(
                "rollout.backend=vllm: vLLM's CPU engine runs Gated DeltaNet layers in bf16 only, off the "
                "learners' fp32 log-probs; generate with rollout.backend=hf (on a GPU vLLM serves them)"
            )
    check_experts(config, model_path, model)


def check_experts(config: Config, model_path: str, model) -> None:
    """What the run asks of a mixture of experts' routers, it can read (:mod:`rltrain.models.routers`):
    the load-balancing loss (``loss.moe_aux_coef``, by default the model's own where its
    transformers code adds one) and routing replay, which needs single-turn generation or the tool
    loop (an episode's turns are not recorded). Each problem is one line naming the setting that runs."""
    from rltrain.models.routers import aux_coef, find_routers, moe_problem

    name, lc = config.model.name_or_path, config.loss
    moe = bool(find_routers(model))
    if lc.moe_aux_coef and not moe:
        raise ConfigError(f"loss.moe_aux_coef={lc.moe_aux_coef}: {name} is not a mixture of experts (no "
                          "load-balancing loss to weigh; leave it unset)")  # fmt: skip
    if config.rollout.routing_replay:
        if not moe:
            raise ConfigError(
                f"rollout.routing_replay: {name} is not a mixture of experts (no routes to replay)"
            )
        for key, value in (("env.name", config.env.name), ("agent.entrypoint", config.agent.entrypoint)):
            if value is not None:
                raise ConfigError(
                    f"rollout.routing_replay with {key}: the routes of an episode's turns are not recorded yet "
                    "(single-turn generation and the tool loop are); set rollout.routing_replay=false"
                )
        if problem := moe_problem(model, "replay"):
            raise ConfigError(f"rollout.routing_replay: {name}: {problem}; set rollout.routing_replay=false")
    coef = aux_coef(model, lc.moe_aux_coef) if moe else 0.0
    if coef > 0 and (problem := moe_problem(model, "aux")):
        given = "" if lc.moe_aux_coef is not None else f" (the model's own router_aux_loss_coef, {coef:g})"
        raise ConfigError(f"loss.moe_aux_coef{given}: the load-balancing loss cannot read {model_path}'s routers: "
                          f"{problem}; set loss.moe_aux_coef=0")  # fmt: skip
