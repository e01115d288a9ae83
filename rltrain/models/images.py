"""A vision-language model's own image processor, turning a sequence's encoded images into what its
forward takes (:class:`rltrain.forward.vision.Images`: the patches and their grids), and rendering a
prompt with images into token ids (its placeholders expanded, one per merged patch), the same way
wherever it runs: the driver renders prompts, the learners and the in-process engine compute
patches, and vLLM (which loads the same processor from the model's folder) expands the placeholders
itself.
"""

from __future__ import annotations

import functools
import re
from collections import OrderedDict
from functools import cached_property

from rltrain.forward.vision import Images
from rltrain.media import decoded


class ImageInputs:
    """The processor of the model at ``model_path``; :meth:`__call__` gives a sequence's
    :class:`Images` from its encoded images, each distinct tuple of them processed once (the
    ``cache`` most recent kept: a group's completions share their prompt's images)."""

    def __init__(self, model_path: str, trust_remote_code: bool = False, cache: int = 256):
        self.model_path, self.trust = model_path, trust_remote_code
        self._cache: OrderedDict[tuple[bytes, ...], Images] = OrderedDict()
        self._size = cache

    @cached_property
    def processor(self):
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(self.model_path, trust_remote_code=self.trust)

    @property
    def image_token(self) -> str:
        return self.processor.image_token

    @property
    def image_token_id(self) -> int:
        return self.processor.tokenizer.convert_tokens_to_ids(self.image_token)

    @cached_property
    def problem(self) -> str | None:
        """Why the learners cannot take this model's images yet, or None: read from what its
        processor gives for an image (its patches' grids) and from its config (rotary positions of
        several axes, which place an image's tokens on its grid), not from its family's name."""
        from transformers import AutoConfig

        from rltrain.forward.model import multi_axis_positions

        out = self.processor.image_processor(images=[decoded(blank_image())], return_tensors="pt")
        config = AutoConfig.from_pretrained(self.model_path, trust_remote_code=self.trust)
        missing = [what for what, there in [("its patches' grids (image_grid_thw)", "image_grid_thw" in out),
                                            ("rotary positions of several axes", multi_axis_positions(config))]
                   if not there]  # fmt: skip
        if not missing:
            return None
        return (f"{type(self.processor).__name__} of {self.model_path} gives {', '.join(sorted(out))} for an image "
                f"and {getattr(config, 'model_type', 'its model')} has no {' and no '.join(missing)}: the learners "
                "take images of vision-language models with both (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) yet")  # fmt: skip

    def __call__(self, images: tuple[bytes, ...]) -> Images:
        if self.problem:
            raise ValueError(self.problem)
        found = self._cache.get(images)
        if found is None:
            out = self.processor.image_processor(images=[decoded(b) for b in images], return_tensors="pt")
            found = Images.of(out["pixel_values"].float(), out["image_grid_thw"])
            self._cache[images] = found
            while len(self._cache) > self._size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(images)
        return found

    def render(self, messages: list[dict], images: tuple[bytes, ...], tools=None, add_generation_prompt=True):
        """``messages`` (an image part per image, in order) through the chat template, each image's
        placeholder expanded: an :class:`~rltrain.batch.ImagePrompt`."""
        from rltrain.batch import ImagePrompt

        if self.problem:
            raise ValueError(self.problem)
        text = self.processor.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        out = self.processor(text=[text], images=[decoded(b) for b in images], return_tensors="pt")
        return ImagePrompt(out["input_ids"][0].tolist(), images, self.image_token_id)


def collapsed(ids: list[int], image_token: int) -> list[int]:
    """``ids`` with each run of ``image_token`` (an expanded image) one token again: what an engine
    that expands placeholders itself (vLLM) takes with the images."""
    return [t for i, t in enumerate(ids) if t != image_token or i == 0 or ids[i - 1] != image_token]


@functools.cache
def blank_image() -> bytes:
    """A small black PNG: what a vision tower runs on where a rank has no image but must run the
    tower as its peers do (:func:`rltrain.forward.vision.forward_inputs`'s ``idle``)."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (28, 28)).save(out, format="PNG")
    return out.getvalue()


# a vision-language model's vision side, by module name: the tower (Qwen2-VL's `visual`, with its
# merger; `vision_tower`/`vision_model` elsewhere) and the projector into the language model
VISION_MODULE = re.compile(r"(^|\.)(visual|vision_tower|vision_model|multi_modal_projector)\.")


def is_vision_parameter(name: str) -> bool:
    """Whether the parameter ``name`` belongs to the model's vision side (``model.freeze_vision``)."""
    return VISION_MODULE.search(name) is not None


def placeholder_ids(config) -> tuple[int, ...]:
    """A vision-language model's image and video placeholder ids (its config's, or its text
    config's), which a policy never samples: an engine leaves them out of sampling and the
    learners' log-probs are of the same distribution (:class:`rltrain.loss.logprobs.Truncation`).
    Empty for a text model."""
    ids = []
    for source in (config, getattr(config, "text_config", None)):
        for key in ("image_token_id", "video_token_id"):
            value = getattr(source, key, None)
            if isinstance(value, int) and value not in ids:
                ids.append(value)
    return tuple(ids)


def has_processor(model_path: str) -> bool:
    """Whether a local model folder holds a processor's files (an image processor's, at least)."""
    from pathlib import Path

    folder = Path(model_path)
    return (folder / "preprocessor_config.json").is_file() or (folder / "processor_config.json").is_file()


def vision_inputs(config, model_path: str | None) -> ImageInputs | None:
    """The :class:`ImageInputs` of the model at ``model_path`` where it has a processor (a
    vision-language model: what renders an environment's, a tool's or an agent's images), else None."""
    if model_path is None or not has_processor(model_path):
        return None
    return ImageInputs(model_path, config.model.trust_remote_code)


def run_images(config, model_path: str) -> ImageInputs | None:
    """Where the rows hold images (:func:`rltrain.data.holds_images`): the model's :class:`ImageInputs`, once
    the model and the run can take images (else one line saying which setting cannot); None
    without it."""
    from rltrain.config import first_line
    from rltrain.data import holds_images

    if not holds_images(config.data):
        return None
    at = "data.image_column" if config.data.image_column else f"data.source={config.data.source}"
    setting = not_with_images(config) or (config.gateway_episodes and "agent.entrypoint or a verifiers env.name "
                                          "(an agent sends its own images, as image_url parts)")  # fmt: skip
    if setting:
        raise ValueError(f"{at}: images are not taken with {setting} yet")
    inputs = ImageInputs(model_path, config.model.trust_remote_code)
    try:
        inputs.image_token  # noqa: B018  (the processor loads and has an image placeholder)
    except Exception as e:
        raise ValueError(f"{at}: {config.model.name_or_path!r} has no image processor to render images "
                         f"with ({first_line(e)}): images need a vision-language model") from None  # fmt: skip
    if inputs.problem:
        raise ValueError(f"{at}: {inputs.problem}")
    return inputs


def check_teacher_images(config, policy: ImageInputs | None) -> None:
    """``algorithm.teacher`` of a vision-language policy (``policy``: its processor; None for a text
    model) must score its sequences' images as images: else one line."""
    if policy is not None and config.algorithm.teacher and (problem := teacher_problem(config, policy)):
        raise ValueError(f"algorithm.teacher: {config.algorithm.teacher}: {problem}; a vision-language "
                         "policy's sequences may hold images, which the teacher must score as images")  # fmt: skip


def teacher_problem(config, policy: ImageInputs) -> str | None:
    """Why ``algorithm.teacher`` cannot score a vision-language policy's sequences with their images
    (it renders them with its own processor, :class:`ImageInputs`: the same placeholders for the
    same picture), or None."""
    from rltrain.config import first_line

    teacher = config.algorithm.teacher
    probe, messages = (blank_image(),), [{"role": "user", "content": [{"type": "image"}]}]
    try:
        theirs = ImageInputs(teacher, config.model.trust_remote_code)
        same = list(theirs.render(messages, probe)) == list(policy.render(messages, probe))
    except Exception as e:
        return f"it has no image processor to render the policy's images with ({first_line(e)})"
    return None if same else "its processor renders a picture into other tokens than the policy's"


def not_with_images(config) -> str | None:
    """The first setting of the run that does not take images yet (rows', an environment's, a
    tool's or an agent's), or None."""
    lc = config.learner
    for problem, setting in [(lc.sequence_parallel_size > 1, "learner.sequence_parallel_size > 1"),
                             (config.algorithm.advantage == "gae", "algorithm.advantage=gae (a critic of images)"),
                             (config.model.lora.rank > 0, "model.lora.rank"),
                             (config.reward.model is not None, "reward.model (a sequence classifier scores text "
                              "alone: it would score the images' placeholders as text)")]:  # fmt: skip
        if problem:
            return setting
    return None
