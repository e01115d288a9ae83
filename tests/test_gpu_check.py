"""scripts/gpu_check.py, the kit a lent GPU machine runs, at tiny sizes on CPU: every part runs,
checks its own comparison, writes its figures, and nothing it imports needs Ray, DeepSpeed, vLLM or
pydantic (a bare GPU machine has none of them)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_gpu_kit_runs_on_cpu_checks_its_comparisons_and_imports_nothing_a_gpu_machine_lacks(tmp_path):
    out = tmp_path / "figures.json"
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["imported"] == []  # of ray, deepspeed, vllm, pydantic (all installed here)
    parts = report["parts"]
    assert set(parts) == {"token_mode", "logprobs", "step", "packed", "moe_aux", "prefix_tree"}
    assert all(parts[name]["ok"] for name in parts)
    assert parts["prefix_tree"]["fp32 gradient rel. diff"] < 1e-5  # a group's prompt computed once
    # the figures behind the verdicts: token mode exact, its control not; hidden-state log-probs exact
    assert parts["token_mode"]["fp32 token mode vs one micro-batch"] < 1e-5
    assert parts["token_mode"]["fp32 per-micro-batch mean vs one micro-batch"] > 1e-2
    assert max(v for k, v in parts["logprobs"].items() if k.endswith("rel. diff")) < 1e-5
    assert parts["step"]["tiny ckpt tokens/s"] > 0 and parts["moe_aux"]["fp32 value rel. diff"] < 1e-5
    assert "every comparison held" in done.stdout


def test_a_part_that_fails_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_check

    def broken(args):
        raise RuntimeError("out of memory")

    monkeypatch.setitem(gpu_check.PARTS, "logprobs", broken)
    out = tmp_path / "figures.json"
    assert gpu_check.main(["--device", "cpu", "--parts", "logprobs", "prefix_tree", "--out", str(out)]) == 1
    parts = json.loads(out.read_text())["parts"]
    assert parts["logprobs"] == {"ok": False, "error": "RuntimeError: out of memory",
                                 "seconds": parts["logprobs"]["seconds"]}  # fmt: skip
    assert parts["prefix_tree"]["ok"] is True  # the next part still ran
