"""Images through a run: prompts rendered by a vision-language model's processor
(builtin:tiny-vl, builtin:shapes), the images kept with a prompt's continuations, trees that share an
image's placeholders only where the image is the same, placeholders never sampled on either side,
a frozen vision tower left out of syncs, and real learners' token-mode update the same in every
layout of a batch with images (the CLI run with vLLM: tests/test_families.py)."""

from __future__ import annotations

import pickle

import pytest
import torch

from rltrain.batch import Completion, ImagePrompt, Segment, collate
from rltrain.config import DataConfig
from rltrain.data import shapes_rows, tokenize_prompts
from rltrain.forward import attention, sequence_logprobs
from rltrain.forward.tree import build_tree, token_keys, tree_logprobs
from rltrain.loss.logprobs import Truncation
from rltrain.media import decoded
from rltrain.models.images import ImageInputs, collapsed, is_vision_parameter
from rltrain.plan import shared_prefix_lengths


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> str:
    from rltrain.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("vl") / "model", family="qwen2_5_vl"))


@pytest.fixture(scope="module")
def shape_prompts(tiny_vl):
    from transformers import AutoTokenizer

    rows = shapes_rows(6, seed=3)
    return tokenize_prompts(rows, AutoTokenizer.from_pretrained(tiny_vl), DataConfig(), ImageInputs(tiny_vl))


def test_an_image_prompt_keeps_its_images_through_continuations_and_transport(shape_prompts):
    prompt = shape_prompts[0].token_ids
    assert isinstance(prompt, ImagePrompt) and len(prompt.images) == 1
    more = prompt + [5, 6]  # a tool round's or an in-flight chunk's continuation
    assert isinstance(more, ImagePrompt) and more.images == prompt.images and list(more[-2:]) == [5, 6]
    back = pickle.loads(pickle.dumps(more))  # as Ray carries a request
    assert back == more and back.images == more.images and back.image_token == more.image_token
    # vLLM takes one placeholder per image and expands it again: 2 x 2 merged patches of 56 x 56
    token = prompt.image_token
    assert list(prompt).count(token) == 4 and collapsed(list(prompt), token).count(token) == 1
    assert len(collapsed(list(prompt), token)) == len(prompt) - 3


def test_rows_of_images_render_through_the_models_processor_and_reach_the_batch(shape_prompts, tiny_vl):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vl)
    texts = {tuple(t for t in p.token_ids if t != p.token_ids.image_token) for p in shape_prompts}
    assert len(texts) == 1  # the same question in every row: only the image answers it
    first = shape_prompts[0]
    expected = processor(
        text=[processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {
            "type": "text", "text": first.row["prompt"]}]}], add_generation_prompt=True, tokenize=False)],
        images=[decoded(first.row["images"][0])], return_tensors="pt")  # fmt: skip
    assert list(first.token_ids) == expected["input_ids"][0].tolist()
    batch = collate([p.token_ids for p in shape_prompts[:2]] + [[1, 2, 3]],
                    [Completion([7, 8], [0.0, 0.0], [1, 1])] * 3, torch.zeros(3), pad_id=0)  # fmt: skip
    batch.validate()
    assert batch.images[:2] == [p.token_ids.images for p in shape_prompts[:2]] and batch.images[2] is None
    assert batch.image_token == first.token_ids.image_token
    chosen = batch.select(torch.tensor([1, 2]))
    assert chosen.images == batch.images[1:] and chosen.image_token == batch.image_token


def test_banned_tokens_leave_the_sampled_distribution(tiny_vl):
    # logits (0, ln 2, ln 3) with token 2 banned: p = (1, 2) / 3 over the rest, so the log-prob of
    # token 1 is ln(2/3); unbanned it is ln(2/6)
    logits = torch.log(torch.tensor([[[1.0, 2.0, 3.0]]]))

    class Head(torch.nn.Module):
        config = None

        def forward(self, input_ids, **_):
            return type("Out", (), {"logits": logits.expand(1, input_ids.shape[1], 3)})()

    ids = torch.tensor([[0, 1]])
    banned, _ = sequence_logprobs(Head(), ids, torch.ones_like(ids), truncation=Truncation(banned=(2,)),
                                  from_hidden=False)  # fmt: skip
    plain, _ = sequence_logprobs(Head(), ids, torch.ones_like(ids), from_hidden=False)
    assert banned[0, 1].item() == pytest.approx(torch.log(torch.tensor(2 / 3)).item(), abs=1e-6)
    assert plain[0, 1].item() == pytest.approx(torch.log(torch.tensor(2 / 6)).item(), abs=1e-6)
    from transformers import AutoConfig

    from rltrain.models.images import placeholder_ids

    config = AutoConfig.from_pretrained(tiny_vl)
    assert set(placeholder_ids(config)) == {config.image_token_id, config.video_token_id}


def test_a_tree_shares_an_images_placeholders_only_where_the_image_is_the_same(shape_prompts, tiny_vl):
    # three completions of one picture's question and two of another picture's: the token ids of all
    # five prompts are equal (the same question, pictures of one size), so a tree by token ids alone
    # would run the second picture's completions on the first picture's features
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_vl, attn_implementation=attention.register())
    model.eval()
    a, b = shape_prompts[0].token_ids, shape_prompts[1].token_ids
    assert list(a) == list(b) and a.images != b.images
    prompts = [a, a, a, b, b]
    completions = [[40, 41, 42], [40, 43], [44], [40, 41, 42], [45, 46]]
    batch = collate(prompts, [Completion(c, [0.0] * len(c), [1] * len(c)) for c in completions],
                    torch.zeros(5), pad_id=0)  # fmt: skip
    images = ImageInputs(tiny_vl)
    per_row = [images(im) for im in batch.images]
    tree = build_tree(batch.input_ids, batch.attention_mask, ~batch.response_mask.bool(), batch.images,
                      batch.image_token)  # fmt: skip
    prompt_len = len(a)
    keys_a, keys_b = (
        token_keys(list(a), a.images, a.image_token),
        token_keys(list(b), b.images, b.image_token),
    )
    diverge = next(t for t, (x, y) in enumerate(zip(keys_a, keys_b)) if x != y)
    assert diverge == list(a).index(a.image_token)  # at the first placeholder
    # the first picture's prompt once, the second's from its first placeholder on once more, and
    # every completion token once (they are trained: never shared): 3 + 2 + 1 and 3 + 2
    assert tree.tokens == prompt_len + (prompt_len - diverge) + (3 + 2 + 1) + (3 + 2)
    assert shared_prefix_lengths(batch)[3] == diverge  # the planner counts alike
    with torch.no_grad():
        shared, _ = tree_logprobs(model, tree, batch.input_ids, images=per_row)
        padded, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, images=per_row)
    response = batch.response_mask.bool()
    torch.testing.assert_close(shared[response], padded[response], rtol=0, atol=1e-5)


def test_a_frozen_vision_tower_stays_out_of_syncs_and_an_engine_keeps_its_own(tiny_vl):
    from transformers import AutoModelForImageTextToText

    from rltrain.config import RolloutConfig
    from rltrain.rollout.hf_backend import HFBackend

    names = [n for n, _ in AutoModelForImageTextToText.from_pretrained(tiny_vl).named_parameters()]
    vision = [n for n in names if is_vision_parameter(n)]
    assert vision and all(n.startswith("model.visual.") for n in vision)
    assert not any(is_vision_parameter(n) for n in names if not n.startswith("model.visual."))
    engine = HFBackend(tiny_vl, RolloutConfig(), [], False)
    state = {k: v + 0.5 for k, v in engine.model.state_dict().items() if not is_vision_parameter(k)}
    before = {k: v.clone() for k, v in engine.model.state_dict().items() if is_vision_parameter(k)}
    engine.load_weights(state.items())  # what a sync with model.freeze_vision sends
    after = engine.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert all(torch.equal(after[k], v) for k, v in state.items())
    missing_text = {k: v for k, v in state.items() if k != "lm_head.weight"}
    with pytest.raises(RuntimeError, match="missing.*lm_head"):
        engine.load_weights(missing_text.items())


@pytest.mark.slow
def test_token_mode_update_with_images_is_the_same_in_every_layout_and_the_naive_mean_is_not(
    ray_local, kept_learners, shape_prompts, tiny_vl
):
    # 8 sequences: two groups of 4 completions (3-12 tokens) of two pictures' prompts (equal token ids)
    # through real learners and DeepSpeed, the vision tower trained too (model.freeze_vision=false).
    # One learner with every sequence padded in one micro-batch, unshared, is the reference; 2 learners
    # packed with prefix trees under ZeRO-2 (one micro-batch each) and ZeRO-3 (a budget of 60 tokens:
    # several micro-batches) give its update; the per-micro-batch mean over 2 x (3 + 1) padded
    # micro-batches does not
    from rltrain.diagnostics import layout_config, relative_difference, updates_after_one_step

    g = torch.Generator().manual_seed(0)
    prompts = [shape_prompts[0].token_ids] * 4 + [shape_prompts[1].token_ids] * 4
    lengths = [3, 12, 5, 8, 4, 10, 6, 7]
    completions = [torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths]
    batch = collate(prompts, [Completion(c, [0.0] * len(c), [1] * len(c)) for c in completions],
                    torch.randn(8, generator=g), pad_id=0)  # fmt: skip
    batch = batch.replace(generator_logprobs=None)

    def unfrozen(config):
        return config.model_copy(update={"model": config.model.model_copy(update={"freeze_vision": False})})

    layouts = {
        "ZeRO-2 packed, trees": layout_config(2, 1, 2, max_tokens_per_micro_batch=400, prefix_sharing=True),
        "ZeRO-3 packed in 60 tokens, trees": layout_config(
            2, 1, 3, max_tokens_per_micro_batch=60, prefix_sharing=True
        ),
    }
    configs = [layout_config(1, 8, 0, prefix_sharing=False), *layouts.values(),
               layout_config(2, 3, 0, None, prefix_sharing=False)]  # fmt: skip
    reference, *updates, naive = updates_after_one_step([unfrozen(c) for c in configs], tiny_vl, batch)
    diffs = {name: relative_difference(update, reference) for name, update in zip(layouts, updates)}
    print(
        f"token-mode update differences with images {diffs}; naive {relative_difference(naive, reference):.3e}"
    )
    assert max(diffs.values()) < 1e-5, diffs
    assert relative_difference(naive, reference) > 1e-2
    assert any(v.abs().max() > 0 for k, v in reference.items() if is_vision_parameter(k))  # the tower trained


def test_the_gateway_serves_image_url_parts_token_in_token_out_and_splits_where_a_new_image_comes(tiny_vl):
    # an agent sends a picture (a data URL) with its question, a text follow-up, then a second
    # picture: the first two calls are one sequence (the follow-up's template tokens inserted, the
    # replies' ids as sampled), the third renders the whole history with both pictures anew
    import base64

    from test_gateway import AGENT, ScriptedEngine
    from transformers import AutoTokenizer

    from rltrain.config import load_config
    from rltrain.episodes.agents import AgentRunner

    tokenizer = AutoTokenizer.from_pretrained(tiny_vl)
    pictures = shapes_rows(2, seed=5)
    urls = [f"data:image/png;base64,{base64.b64encode(r['images'][0]).decode()}" for r in pictures]
    seen = []

    def reply(prompt):
        seen.append(prompt)
        return tokenizer.encode("red", add_special_tokens=False) + [tokenizer.eos_token_id]

    runner = AgentRunner(load_config(None, AGENT), tokenizer, tiny_vl)
    try:
        (c,) = runner.run(
            ScriptedEngine(reply, tokenizer), [{"id": "p", "mode": "images", "images": urls}], [0]
        )
    finally:
        runner.server.stop()
    first, second = pictures[0]["images"][0], pictures[1]["images"][0]
    assert [p.images for p in seen] == [(first,), (first,), (first, second)]  # each call with its pictures
    assert len(c.earlier) == 1  # the new picture split the episode
    opening, last = c.earlier[0], c
    token = opening.prompt_ids.image_token
    assert list(opening.prompt_ids).count(token) == 4 and list(last.prompt_ids).count(token) == 8
    assert (
        list(seen[1])
        == list(opening.prompt_ids) + opening.token_ids[: len(seen[1]) - len(opening.prompt_ids)]
    )
    batch = collate([opening.prompt_ids, last.prompt_ids], [opening, last], torch.zeros(2), pad_id=0)
    assert batch.images == [(first,), (first, second)] and batch.image_token == token
    # a checkpoint of completions generated ahead keeps their pictures (JSON: base64)
    import json

    back = Completion.from_state(json.loads(json.dumps(last.state())))
    assert back.prompt_ids == last.prompt_ids and back.prompt_ids.images == (first, second)
    assert back.earlier[0].prompt_ids.images == (first,)


def _play_shapes(tiny_vl, turns: list[str], limits=None, images=True, parser=None):
    """``builtin:shapes``' episode (its real process) on a row of builtin:shapes, the policy played by
    ``turns`` (each an assistant turn's text, sampled as the tiny tokenizer encodes it, then <|im_end|>)."""
    from transformers import AutoTokenizer

    from rltrain.envs import tool_schemas
    from rltrain.episodes.chat import ChatRenderer
    from rltrain.episodes.env_host import EnvHost
    from rltrain.episodes.episode_state import EpisodeLimits
    from rltrain.episodes.parsers import HermesParser
    from rltrain.episodes.turns import run_episodes
    from rltrain.models.tiny import build_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_vl) if images else build_tokenizer()
    sampled = [tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id] for t in turns]
    seen = []

    def generate(prompts, max_tokens, seeds):
        seen.extend(prompts)
        planned = sampled[len(seen) - 1]
        return [Segment(planned[: max_tokens[0]], [-0.5] * min(len(planned), max_tokens[0]), turns[len(seen) - 1],
                        "length" if len(planned) > max_tokens[0] else "stop")]  # fmt: skip

    host = EnvHost("builtin:shapes", {"looks": 2, "zoom": 2})
    limits = limits or EpisodeLimits(
        max_new_tokens=400, max_model_len=1024, max_prompt_tokens=200, max_turns=4
    )
    renderer = ChatRenderer(
        tokenizer, tool_schemas(host.tools), images=ImageInputs(tiny_vl) if images else None
    )
    row = shapes_rows(1, seed=7)[0]
    try:
        (c,) = run_episodes(
            generate, host, renderer, parser or HermesParser(), tokenizer.encode, [row], [0], limits
        )
    finally:
        host.shutdown()
    return c, row, seen, renderer


def test_an_environments_and_a_tools_images_join_the_sequence_as_the_processor_renders_the_whole_episode(
    tiny_vl,
):
    # builtin:shapes opens with the row's 56 px picture; a wrong answer is shown it 2x larger
    # (112 px), the look tool returns it 3x larger (168 px); the right colour then ends the episode
    import json

    from rltrain.media import described

    answer = shapes_rows(1, seed=7)[0]["answer"]
    call = '<tool_call>{"name": "look", "arguments": {"zoom": 3}}</tool_call>'
    c, row, seen, renderer = _play_shapes(tiny_vl, ["purple", call, answer])
    assert (c.finish_reason, c.env_reward, c.turns, c.tool_calls, c.errors) == ("stop", 1.0, 3, 1, {})
    sequence = list(c.prompt_ids) + c.token_ids
    images = c.prompt_ids.images
    assert images[0] == row["images"][0] and [decoded(b).size for b in images[1:]] == [(112, 112), (168, 168)]
    # each engine call had every image its prompt holds: 1, then 2, then 3
    assert [len(p.images) for p in seen] == [1, 2, 3] and all(list(p) == sequence[: len(p)] for p in seen)
    # the whole episode in one rendering by the processor: the sampled turns are the template's own
    # (their ids as sampled), the rest the template's, each image's placeholder run in its place
    picture = [{"type": "image", "image": b} for b in images]
    conversation = [{"role": "user", "content": [picture[0], {"type": "text", "text": row["prompt"]}]},
                    {"role": "assistant", "content": "purple"},
                    {"role": "user", "content": [picture[1], {"type": "text", "text": "Look closer."}]},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "look", "arguments": {"zoom": 3}}}]},
                    {"role": "tool", "name": "look", "content": [picture[2]]},
                    {"role": "assistant", "content": answer}]  # fmt: skip
    whole = ImageInputs(tiny_vl).render(conversation, images, renderer.tools, add_generation_prompt=False)
    assert sequence == list(whole)[:-1]  # (the template's newline after the last <|im_end|>)
    # the same conversation written out (a warm start's example) is built exactly as the episode was
    from rltrain.episodes.chat import render_conversations

    ((prompt, completion, mask),) = render_conversations([(conversation, renderer.tools)], renderer.tokenizer,
                                                         images=ImageInputs(tiny_vl))  # fmt: skip
    assert (prompt, prompt.images, completion, mask) == (c.prompt_ids, images, c.token_ids, c.tool_mask)
    # 56 / 28 = 2 merged patches a side: 4 placeholders; 112 px: 4 x 4 = 16; 168 px: 6 x 6 = 36
    token = c.prompt_ids.image_token
    runs = [len(r) for r in "".join("x" if t == token else " " for t in sequence).split()]
    assert runs == [4, 16, 36]
    assert all(m == 0 for t, m in zip(c.token_ids, c.tool_mask) if t == token)  # never loss tokens
    batch = collate([c.prompt_ids], [c], torch.zeros(1), pad_id=0)
    assert batch.images == [images] and batch.image_token == token
    keys = token_keys(sequence, images, token)
    assert [k[1] for k in keys if isinstance(k, tuple)] == [images[0]] * 4 + [images[1]] * 16 + [
        images[2]
    ] * 36
    # what the run keeps on disk and in checkpoints: each picture named, the sequence's images whole
    assert json.dumps(c.messages) and c.messages == described(c.messages)
    assert c.messages[4]["content"][0]["image"].startswith("<image 168x168 PNG, sha1 ")
    back = Completion.from_state(json.loads(json.dumps(c.state())))
    assert back.prompt_ids.images == images
    # the driver's batch of it trains, and where a setting cannot take images the run stops in one line
    from rltrain.config import load_config
    from rltrain.data import Prompt
    from rltrain.run.scoring import ScoredGroups, build_batch

    scored = ScoredGroups([Prompt(0, [], answer, row)] * 2, [c, back], torch.tensor([1.0, 0.0]), {})
    config = load_config("configs/cpu_vision.yaml", ["algorithm.group_size=2", "env.name=builtin:shapes"])
    assert build_batch(scored, config, pad_id=0).images == [images, images]
    lora = load_config(
        "configs/cpu_vision.yaml", ["algorithm.group_size=2", "env.name=builtin:shapes", "model.lora.rank=4"]
    )
    with pytest.raises(ValueError, match=r"an episode's images .* are not taken with model.lora.rank yet"):
        build_batch(scored, lora, pad_id=0)


def test_a_bad_image_an_image_past_the_room_and_an_image_for_a_text_model_end_their_episode_alone(tiny_vl):
    from rltrain.episodes.episode_state import EpisodeLimits

    # over data.max_image_pixels: the 56 x 56 = 3,136-pixel picture passes, the 112 x 112 one does not
    limits = EpisodeLimits(400, 1024, 200, max_turns=4, max_image_pixels=56 * 56)
    c, *_ = _play_shapes(tiny_vl, ["purple"], limits)
    assert (c.finish_reason, c.errors) == ("error", {"image": 1})
    assert "12,544 pixels), over data.max_image_pixels=3,136" in c.failures["environment step"]
    assert len(c.prompt_ids.images) == 1 and [m["role"] for m in c.messages] == ["user", "assistant"]
    # the zoomed picture's addition (its 16 placeholders) does not fit in what is left: the episode
    # ends at its length before the image, never inside its placeholders
    prompt_len = len(
        _play_shapes(tiny_vl, ["purple"], EpisodeLimits(400, 1024, 200, max_turns=1))[0].prompt_ids
    )
    c, *_ = _play_shapes(tiny_vl, ["purple"], EpisodeLimits(400, prompt_len + 20, 200, max_turns=4))
    token = c.prompt_ids.image_token
    assert c.finish_reason == "length" and len(c.prompt_ids.images) == 1 and token not in c.token_ids
    # a model without an image processor: the opening's picture ends the episode, named in one line
    c, *_ = _play_shapes(tiny_vl, ["purple"], images=False)
    assert (c.finish_reason, c.errors, c.token_ids) == ("error", {"image": 1}, [])
    assert "takes none (it has no image processor)" in c.failures["environment reset"]
    # a tool's picture where results are text inside the turn (tag): named, counted as the tool's
    from rltrain.episodes.parsers import TagParser

    c, *_ = _play_shapes(tiny_vl, ["<tool:look>2</tool>"], parser=TagParser())
    assert (c.finish_reason, c.errors, c.tool_errors) == ("error", {"image": 1}, 1)
    assert "rollout.tool_parser=tag writes a result inside the turn as text" in c.failures["tool look"]


@pytest.mark.parametrize("kind", ["llava", "gemma3"])
def test_a_vision_language_model_whose_processor_gives_no_grids_is_refused_at_start_up_in_one_line(
    kind, tmp_path
):
    # LLaVA's and Gemma 3's processors give an image's pixels without the patch grids that place its
    # tokens, and their rotary positions have one axis: preflight refuses the run's images, naming
    # what is missing (read from the processor's output and the config), where the learners once
    # raised KeyError('image_grid_thw') at the first step
    from model_utils import vision_model_without_grids

    from rltrain.config import ConfigError, load_config
    from rltrain.run.preflight import preflight

    folder = vision_model_without_grids(kind, tmp_path / kind)
    config = load_config("configs/cpu_vision.yaml", [f"model.name_or_path={folder}", "sft_warmup.steps=0",
                                                     f"run.output_dir={tmp_path / 'run'}"])  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        preflight(config)
    line = str(refused.value)
    assert line.startswith("data.source=builtin:shapes:") and "\n" not in line, line
    assert "image_grid_thw" in line and "rotary positions of several axes" in line and "Qwen2.5-VL" in line


def test_every_model_that_scores_images_takes_them_or_the_run_stops_at_start_up(tiny_vl, tmp_path):
    # a reward model (a sequence classifier: it scores text alone) would score the images'
    # placeholders as text: refused in one line where the rows hold images; a teacher without an
    # image processor too. A teacher that renders a picture as the policy does scores it with its own
    # processor (its folder's, not the policy's)
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config

    from rltrain.config import ConfigError, load_config
    from rltrain.learner.frozen import TeacherLearner
    from rltrain.models.tiny import build_tiny_model
    from rltrain.run.preflight import preflight

    scorer = tmp_path / "scorer"
    text = AutoConfig.from_pretrained(tiny_vl).text_config.to_dict()
    keep = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "pad_token_id"}  # fmt: skip
    config = Qwen2Config(**{k: v for k, v in text.items() if k in keep}, num_labels=1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(scorer)
    AutoTokenizer.from_pretrained(tiny_vl).save_pretrained(scorer)
    base = ["sft_warmup.steps=0", f"run.output_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError) as refused:
        preflight(load_config("configs/cpu_vision.yaml", [*base, f"reward.model={scorer}",
                                                          "reward.functions={exact_match: 1.0, model: 1.0}"]))  # fmt: skip
    line = str(refused.value)
    assert "images are not taken with reward.model" in line and "placeholders" in line and "\n" not in line
    distill = [*base, "algorithm.advantage=distill"]
    with pytest.raises(ConfigError) as refused:
        preflight(load_config("configs/cpu_vision.yaml", [*distill, f"algorithm.teacher={scorer}"]))
    line = str(refused.value)
    assert line.startswith(f"algorithm.teacher: {scorer}: it has no image processor") and "\n" not in line
    teacher = str(build_tiny_model(tmp_path / "teacher", family="qwen2_5_vl", seed=1))
    preflight(load_config("configs/cpu_vision.yaml", [*distill, f"algorithm.teacher={teacher}"]))
    config = load_config("configs/cpu_vision.yaml", [*distill, f"algorithm.teacher={teacher}"])
    learner = TeacherLearner.__new__(TeacherLearner)
    learner.config, learner.model_path = config, tiny_vl
    assert learner._scored_path() == teacher  # the processor its images are rendered with
