"""Every key `--help-config` lists, tried with boundary values: each value is either accepted or
refused with one ConfigError line that names the key; never another exception."""

import pytest

from rltrain.config import ConfigError, describe, load_config

KEYS = [line.split(" = ")[0] for line in describe().splitlines() if not line.startswith(" ")]
# zero, negative, not finite, huge, the wrong type, empty, a path that is not there
BOUNDARY = ["0", "-1", ".nan", ".inf", "1e30", "[1, 2]", "{a: 1}", "''", "/no/such/path"]


def test_the_walk_covers_every_section():
    sections = {key.split(".")[0] for key in KEYS}
    assert {"model", "learner", "loss", "algorithm", "rollout", "data", "reward", "env", "critic",
            "run"} <= sections, sections  # fmt: skip
    assert len(KEYS) > 100


@pytest.mark.parametrize("key", KEYS)
def test_every_key_takes_boundary_values_or_refuses_them_in_one_line_naming_it(key):
    # `critic.*` keys exist once the critic section does (PPO with GAE)
    base = ["algorithm.advantage=gae"] if key.startswith("critic.") else []
    for value in BOUNDARY:
        try:
            load_config(None, [*base, f"{key}={value}"])
        except ConfigError as e:
            message = str(e)
            assert "\n" not in message, (key, value, message)
            leaf = key.split(".")[-1]
            # the key itself, or the cross-section check's own naming of it
            assert leaf in message or key.split(".")[0] in message, (key, value, message)


def test_every_key_is_documented_for_help_config():
    lines = describe().splitlines()
    for i, line in enumerate(lines):
        if not line.startswith(" "):  # a key; its documentation follows, indented
            assert i + 1 < len(lines) and lines[i + 1].startswith("    ") and lines[i + 1].strip(), line


@pytest.mark.slow
def test_values_the_schema_accepts_pass_every_check_before_the_actors_or_stop_in_one_line(
    tmp_path, monkeypatch
):
    from rltrain.run import preflight as checks

    # the prompts' tokenization is the same for every value that leaves the data, the tokenizer and
    # the rows alone (most of the ~130 configs): done once per distinct input, as preflight did it.
    # (The tokenizer by its content: each config's built-in model, tokenizer included, is written
    # into its own output folder, so its path differs from config to config.)
    tokenized, tokenize = {}, checks.tokenize_prompts

    def tokenize_once(rows, tokenizer, data, images=None):
        if images is not None:  # (rows with images: rendered by their model's processor)
            return tokenize(rows, tokenizer, data, images)
        key = (
            tokenizer.backend_tokenizer.to_str(),
            tokenizer.chat_template,
            data.model_dump_json(),
            hash(tuple(r["prompt"] for r in rows)),
        )
        if key not in tokenized:
            tokenized[key] = tokenize(rows, tokenizer, data)
        return tokenized[key]

    monkeypatch.setattr(checks, "tokenize_prompts", tokenize_once)
    monkeypatch.chdir(tmp_path)  # relative paths among the values land here
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub name fails at once rather than after retries
    tried = 0
    for i, key in enumerate(KEYS):
        base = ["algorithm.advantage=gae"] if key.startswith("critic.") else []
        for j, value in enumerate(BOUNDARY):
            overrides = [*base, f"run.output_dir={tmp_path / f'run_{i}_{j}'}", f"{key}={value}"]
            try:
                config = load_config(None, overrides)
            except ConfigError:
                continue  # the schema walk above covers these
            tried += 1
            try:
                checks.preflight(config)
            except ConfigError as e:
                assert "\n" not in str(e), (key, value, str(e))
                assert key.split(".")[-1] in str(e) or key.split(".")[0] in str(e), (key, value, str(e))
    assert tried > 50  # the values the schema takes (about a hundred)
