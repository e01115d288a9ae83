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
