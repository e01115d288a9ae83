"""Six public chat templates (tests/fixtures/chat_templates, as the models ship them) with the
built-in byte-level tokenizer plus each one's special tokens: every family runs an episode with
tool calls in its own format and a second user turn, and a written conversation builds exactly the
sequence an episode builds, under the render mode preflight names for it."""

from pathlib import Path

import pytest
from envs_for_tests import SystemChainEnv

from rltrain.batch import Segment
from rltrain.envs import ChainEnv, tool_schemas
from rltrain.episodes.chat import ChatRenderer, TemplateError, render_problem, with_call_ids
from rltrain.episodes.env_host import EnvHost
from rltrain.episodes.episode_state import EpisodeLimits
from rltrain.episodes.parsers import get_parser
from rltrain.episodes.tools import SEED_STRIDE
from rltrain.episodes.turns import run_episodes
from rltrain.models.tiny import build_tokenizer

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
LLAMA = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
MISTRAL = ["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
           "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]  # fmt: skip
# family: (template file, extra special tokens, bos, eos, tool parser, the render mode it needs)
FAMILIES = {
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct", [], None, "<|im_end|>", "hermes", "full"),
    "qwen3": ("Qwen-Qwen3-0.6B", [], None, "<|im_end|>", "hermes", "last_turn"),  # drops earlier reasoning
    "qwq": ("Qwen-QwQ-32B", [], None, "<|im_end|>", "hermes", "last_turn"),
    # writes "\n</tool_response>\n" for a tool message that is not last, "\n</tool_response>" for one that is
    "hermes3": ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", [], "<|begin_of_text|>", "<|im_end|>", "hermes", "last_turn"),
    "llama3.3": ("meta-llama-Llama-3.3-70B-Instruct", LLAMA, "<|begin_of_text|>", "<|eot_id|>", "llama3_json", "full"),
    # moves its tool list before the last user message
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407", MISTRAL, "<s>", "</s>", "mistral", "last_turn"),
}  # fmt: skip
THINKS = {"qwen3", "qwq"}
REASONING = "<think>\nThe calculator knows.\n</think>\n\n"
LIMITS = EpisodeLimits(max_new_tokens=3000, max_model_len=6000, max_prompt_tokens=3000, max_turns=8,
                       max_tool_calls=8, step_timeout_s=5.0, tool_timeout_s=2.0)  # fmt: skip


def tokenizer_for(family: str):
    name, special, bos, eos, _, _ = FAMILIES[family]
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [t for t in LLAMA + MISTRAL if t in special]})
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    tok.eos_token = eos
    if bos is not None:
        tok.bos_token = bos
    tok.name_or_path = family
    return tok


def demonstration(family: str) -> list[dict]:
    """The chain task, two links, each answered with a calculator call: a tool message that is not
    last and a second user turn; reasoning models think before every turn."""
    env = ChainEnv(links=2, tool_fraction=1.0)
    messages = env.demonstration({"answer": "7"})
    if family in THINKS:
        messages = [
            {**m, "content": REASONING + m["content"]} if m["role"] == "assistant" else m for m in messages
        ]
    return messages


def replay(ids: list[int], mask: list[int], tok):
    """An engine that samples, round after round, the runs of mask-1 ids of a built conversation."""
    turns, run = [], []
    for i, m in zip(ids, mask):
        if m:
            run.append(i)
        elif run:
            turns, run = [*turns, run], []
    turns += [run] if run else []

    def generate(prompts, max_tokens, seeds):
        return [Segment(turns[s // SEED_STRIDE], [-0.5] * len(turns[s // SEED_STRIDE]),
                        tok.decode(turns[s // SEED_STRIDE], skip_special_tokens=True), "stop") for s in seeds]  # fmt: skip

    return generate


def episode(family: str, mode: str, generate, tok, env: str = "builtin:chain"):
    host = EnvHost(env, {"links": 2, "tool_fraction": 1.0})
    try:
        schemas = tool_schemas(host.tools)
        renderer = ChatRenderer(tok, schemas, mode)
        parser = get_parser(FAMILIES[family][4], tok, schemas)
        encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
        (c,) = run_episodes(generate, host, renderer, parser, encode, [{"answer": "7"}], [0], LIMITS)
        return c
    finally:
        host.shutdown()


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_runs_its_episodes_as_its_warm_up_examples_are_built(family):
    tok, mode = tokenizer_for(family), FAMILIES[family][5]
    schemas = tool_schemas(ChainEnv.tools)
    prompt, completion, mask = ChatRenderer(tok, schemas, mode).conversation(demonstration(family))
    c = episode(family, mode, replay(completion, mask, tok), tok)
    # the chain's two links, both through a call in the family's own format, both right
    assert (c.finish_reason, c.env_reward, c.tool_calls, c.errors) == ("stop", 1.0, 2, {})
    assert (c.prompt_ids, c.token_ids, c.tool_mask) == (prompt, completion, mask)
    assert [m["role"] for m in c.messages] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
        "tool",
        "assistant",
    ]


@pytest.mark.parametrize("family", sorted(THINKS))
def test_a_reasoning_models_turns_written_without_reasoning_build_as_its_episodes_do(family):
    # QwQ opens every generation prompt with "<think>\n", which a turn written without reasoning does
    # not render: the turn's ids start inside the generation prompt, which stays in the context as
    # the policy saw it (mask 0) -- the warm start on such conversations raised TemplateError
    tok, schemas = tokenizer_for(family), tool_schemas(ChainEnv.tools)
    messages = ChainEnv(links=2, tool_fraction=1.0).demonstration({"answer": "7"})  # no reasoning
    prompt, completion, mask = ChatRenderer(tok, schemas, "last_turn").conversation(messages)
    c = episode(family, "last_turn", replay(completion, mask, tok), tok)
    assert (c.finish_reason, c.env_reward, c.tool_calls, c.errors) == ("stop", 1.0, 2, {})
    assert (c.prompt_ids, c.token_ids, c.tool_mask) == (prompt, completion, mask)
    if family == "qwq":
        think = tok.encode("<think>\n", add_special_tokens=False)
        assert prompt[-len(think) :] == think  # the policy's context ends with the opened thought
        sampled = [t for t, m in zip(completion, mask) if m]
        assert tok.decode(sampled).startswith('<tool_call>\n{"name": "calculator"')  # no thought in it


def test_a_template_that_moves_the_system_prompt_runs_under_last_turn_and_preflight_says_so():
    # Mistral writes the system prompt (and the tools) into the last user message: once a turn
    # follows, the opening renders otherwise. Episodes under last_turn are exact (the opening as
    # the policy saw it, each turn read after the stand-in), so preflight accepts last_turn and
    # refuses full, and a written conversation builds what an episode builds
    tok, schemas = tokenizer_for("mistral-nemo"), tool_schemas(ChainEnv.tools)
    opening = [SystemChainEnv.SYSTEM, {"role": "user", "content": "What is 1 + 2?"}]
    assert render_problem(tok, schemas, opening, "last_turn") is None
    assert "changes earlier turns" in render_problem(tok, schemas, opening, "full")
    messages = SystemChainEnv(links=2, tool_fraction=1.0).demonstration({"answer": "7"})
    prompt, completion, mask = ChatRenderer(tok, schemas, "last_turn").conversation(messages)
    c = episode(
        "mistral-nemo", "last_turn", replay(completion, mask, tok), tok, "envs_for_tests:SystemChainEnv"
    )
    assert (c.finish_reason, c.env_reward, c.tool_calls, c.errors) == ("stop", 1.0, 2, {})
    assert (c.prompt_ids, c.token_ids, c.tool_mask) == (prompt, completion, mask)
    assert "You add and subtract" in tok.decode(prompt)


def test_a_tool_result_answers_the_call_under_the_id_the_model_wrote():
    # Mistral-Nemo writes each call's id itself; vLLM's parser makes up another (random) one, and
    # the episode, seeing none of its own in the text, made "call00000": the result's tokens then
    # answered another id than the model's call. The tokens must equal the episode's messages
    # rendered, each result under the id its call was written with
    tok = tokenizer_for("mistral-nemo")
    call = '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "1 + 2"}, "id": "call00001"}]'
    turns = [tok.encode(call, add_special_tokens=False) + [tok.eos_token_id]]
    turns += [tok.encode(text, add_special_tokens=False) + [tok.eos_token_id] for text in ("3", "7")]

    def generate(prompts, max_tokens, seeds):
        return [Segment(turns[min(s // SEED_STRIDE, 2)], [-0.5] * len(turns[min(s // SEED_STRIDE, 2)]),
                        "", "stop") for s in seeds]  # fmt: skip

    c = episode("mistral-nemo", "last_turn", generate, tok)
    text = tok.decode(c.token_ids, skip_special_tokens=False)
    assert '"call_id": "call00001"' in text and "call00000" not in text
    (tool,) = [m for m in c.messages if m["role"] == "tool"]
    assert tool["tool_call_id"] == "call00001"
    schemas = tool_schemas(ChainEnv.tools)
    assert ChatRenderer(tok, schemas, "last_turn").conversation(c.messages) == (
        c.prompt_ids,
        c.token_ids,
        c.tool_mask,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_preflight_names_the_render_mode_each_family_needs(family):
    tok, mode = tokenizer_for(family), FAMILIES[family][5]
    opening = [{"role": "user", "content": "What is 1 + 2?"}]
    schemas = tool_schemas(ChainEnv.tools)
    assert render_problem(tok, schemas, opening, mode) is None
    if mode == "last_turn":  # the full history is rewritten: preflight says so, and so does the episode
        problem = render_problem(tok, schemas, opening, "full")
        assert problem is not None and "changes earlier turns" in problem
        with pytest.raises(TemplateError):
            ChatRenderer(tok, schemas, "full").conversation(demonstration(family))


def test_a_template_error_ends_its_episode_not_the_run():
    # Mistral's template raises unless user and assistant turns alternate: the episode whose
    # environment answers with two user messages ends with finish reason error, counted, the
    # template's message kept for the console; the other episode of the call finishes
    tok = tokenizer_for("mistral-nemo")
    sampled = tok.encode("fine", add_special_tokens=False) + [tok.eos_token_id]

    def generate(prompts, max_tokens, seeds):
        return [Segment(sampled, [-0.5] * len(sampled), "fine", "stop") for _ in seeds]

    host = EnvHost("envs_for_tests:TwoUsersEnv", {})
    try:
        renderer, parser = ChatRenderer(tok, None, "last_turn"), get_parser("mistral", tok)
        encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
        rows = [{"answer": "twice"}, {"answer": "once"}]
        broken, fine = run_episodes(generate, host, renderer, parser, encode, rows, [0, 1], LIMITS)
    finally:
        host.shutdown()
    assert (broken.finish_reason, broken.errors) == ("error", {"template": 1})
    assert "roles must alternate user/assistant" in broken.failures["chat template"]
    assert (fine.finish_reason, fine.env_reward, fine.errors) == ("stop", 1.0, {})


def test_tool_call_ids_pair_calls_and_results_in_order():
    messages = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "a"}}, {"function": {"name": "b"}}],
        },
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
        {"role": "tool", "content": "3"},  # answers no call: a fresh id
        {"role": "assistant", "content": "", "tool_calls": [{"id": "mine12345", "function": {"name": "a"}}]},
        {"role": "tool", "content": "4"},
    ]
    out = with_call_ids(messages)
    assert [c["id"] for c in out[1]["tool_calls"]] == ["call00000", "call00001"]
    assert [m.get("tool_call_id") for m in out[2:5]] == ["call00000", "call00001", "call00002"]
    assert out[5]["tool_calls"][0]["id"] == "mine12345" and out[6]["tool_call_id"] == "mine12345"
    assert all(len(m.get("tool_call_id", "123456789")) == 9 for m in out)  # Mistral's form
