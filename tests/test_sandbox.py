"""The python tool is contained: each hostile program ends as a tool error in the completion (tool
mask 0), the rollout goes on, and nothing outside the sandbox is touched or left running."""

import os
import time
from pathlib import Path

import psutil
import pytest

from rltrain.batch import Segment
from rltrain.episodes.tools import ToolRunner, generate_with_tools
from rltrain.sandbox import Limits, isolation_problem, run_python

needs_isolation = pytest.mark.skipif(
    isolation_problem() is not None, reason=f"no isolation here: {isolation_problem()}"
)
LIMITS = Limits(memory_mb=256, cpu_s=3, processes=8, file_size_mb=1)
SECRET = "RLTRAIN_TEST_SECRET"


def hostile(tmp: Path) -> dict[str, tuple[str, str | tuple[str, ...]]]:
    """program -> (code, what the tool's error line must say: one of them, where a tuple)"""
    return {
        "memory hog": ("x = []\nwhile True: x.append(' ' * 10**6)", "MemoryError"),
        # (on a loaded machine the process limit can end it before the time limit does)
        "fork loop": ("import os\nwhile True: os.fork()", ("timed out after 2s", "BlockingIOError")),
        "infinite loop": ("while True: pass", "timed out after 2s"),
        "write outside": (f"open({str(tmp / 'escaped')!r}, 'w').write('x')", "PermissionError"),
        "trainer environment": (f"import os; print(os.environ[{SECRET!r}])", f"KeyError: '{SECRET}'"),
        "trainer /proc": (f"print(open('/proc/{os.getpid()}/environ').read())", "PermissionError"),
        "socket": ("import socket; socket.create_connection(('1.1.1.1', 53), timeout=1)", "Network is unreachable"),
        "huge output": ("while True: print('x' * 1000)", "File too large"),
    }  # fmt: skip


def descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@needs_isolation
def test_hostile_programs_end_as_tool_errors_and_the_rollout_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv(SECRET, "hunter2")
    programs = hostile(tmp_path)
    replies = {i: [f"<tool:python>{code}</tool>", " done"] for i, (code, _) in enumerate(programs.values())}

    def generate(prompts, max_tokens, seeds):
        return [
            Segment([1] * len(t), [0.0] * len(t), t, "stop") for t in (replies[p[0]].pop(0) for p in prompts)
        ]

    before = descendants()
    runner = ToolRunner(["python"], timeout_s=2.0, max_output_chars=300, limits=LIMITS)
    encode = lambda text: [2] * len(text)  # noqa: E731
    completions = generate_with_tools(
        generate, encode, [[i] for i in replies], 2000, runner, 1, [0] * len(replies)
    )
    for (name, (code, expected)), c in zip(programs.items(), completions):
        result = c.text[c.text.index("<result>") : c.text.index("</result>") + len("</result>")]
        said = (expected,) if isinstance(expected, str) else expected
        assert result.startswith("<result>error: ") and any(s in result for s in said), (name, result)
        assert c.tool_errors == 1 and c.text.endswith(" done"), name  # generation went on after the error
        # the result's tokens carry tool mask 0: call tokens 1, result 0, " done" 1
        call = len(f"<tool:python>{code}</tool>")
        assert c.tool_mask == [1] * call + [0] * len(result) + [1] * len(" done"), name
    assert not (tmp_path / "escaped").exists()
    deadline = (
        time.monotonic() + 10
    )  # (killed processes are reaped a moment later, on a loaded machine later still)
    while not descendants() <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert descendants() <= before  # nothing it started survives (fork loop included)


@needs_isolation
def test_the_code_writes_and_reads_its_own_folder_only():
    result = run_python("open('note', 'w').write('hi'); print(open('note').read())", 5, LIMITS)
    assert result.ok and result.stdout == "hi\n"
    result = run_python("print(open(__import__('os').path.expanduser('~/.bashrc')).read())", 5, LIMITS)
    assert not result.ok  # the home folder (any file outside the installation) is not readable


def test_the_python_tool_refuses_when_it_cannot_isolate(monkeypatch):
    monkeypatch.setenv(SECRET, "hunter2")
    # a platform without user namespaces, simulated: unshare(2) fails inside the bootstrap
    import rltrain.sandbox as sandbox

    monkeypatch.setattr(
        sandbox, "BOOTSTRAP", sandbox.BOOTSTRAP.replace("libc.unshare(", "-1 + 0 * libc.getpid(")
    )
    result = run_python("print('ran')", 5, LIMITS)
    assert not result.ok and result.stdout == ""
    assert result.error.startswith("sandbox: cannot create user/network/pid namespaces")
    out, ok = ToolRunner(["python"], 5.0, 200, LIMITS)("python", "print('ran')")
    assert not ok and out.startswith("<result>error: sandbox: cannot create")
    # opted out: the limits alone, still an empty environment
    assert (
        run_python(f"import os; print({SECRET!r} in os.environ)", 5, LIMITS, isolate=False).stdout
        == "False\n"
    )
