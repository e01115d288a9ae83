"""Run model-written Python contained: limits, no network, writes only to its own folder.

Each call gets a fresh temporary folder and a fresh interpreter (``python -I -S``, empty
environment, no inherited file descriptors) started through a small stdlib-only bootstrap that,
before the code runs:

- sets ``resource`` limits: address space, CPU time, processes, file size, open files, no core;
- enters new user, network and PID namespaces (no network interfaces at all; the host's processes
  are out of reach; the code runs as PID 1 of its namespace, so everything it starts dies with it);
- applies a Landlock ruleset: reads only under the Python installation and system libraries, writes
  only in its folder, no signals or abstract sockets outside its domain (which also hides the
  trainer's ``/proc/<pid>/environ``).

The whole process group is killed on timeout. Where the platform cannot isolate (no user
namespaces, no Landlock) the bootstrap refuses with exit code 125 and says why, unless the caller
opted out (``isolate=False``), in which case only the limits apply. Linux only for isolation.
No ray, no deepspeed, no torch.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REFUSED = 125  # the bootstrap's exit code when it cannot set up what was asked

# Runs as `python -I -S -c BOOTSTRAP <settings json> <code>`: stdlib only, nothing imported from rltrain.
BOOTSTRAP = r"""
import ctypes, json, os, resource, sys
s, code = json.loads(sys.argv[1]), sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def refuse(what):
    sys.stderr.write(f"sandbox: {what}: {os.strerror(ctypes.get_errno())}\n")
    os._exit(125)

if s["isolate"]:
    # new user + network + pid namespaces: no interfaces, no host processes, no host privileges
    if libc.unshare(0x10000000 | 0x40000000 | 0x20000000) != 0:
        refuse("cannot create user/network/pid namespaces")
    abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        refuse("Landlock is not available")
    write = (1 << 1) | (0b111111111 << 4) | ((1 << 13) if abi >= 2 else 0) | ((1 << 14) if abi >= 3 else 0)
    read, execute, read_dir = 1 << 2, 1 << 0, 1 << 3
    handled = read | execute | read_dir | write | ((1 << 15) if abi >= 5 else 0)
    file_rights = execute | read | (1 << 1) | ((1 << 14) if abi >= 3 else 0) | ((1 << 15) if abi >= 5 else 0)
    attr = (ctypes.c_uint64 * 3)(handled, 0, 0b11 if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(444, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        refuse("cannot create a Landlock ruleset")

    class Beneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]

    for path, rights in [(p, read | execute | read_dir) for p in s["readable"]] + [(s["workdir"], handled)]:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        allowed = rights if os.path.isdir(path) else rights & file_rights
        rule = Beneath(allowed, fd)
        if libc.syscall(445, ctypes.c_int(ruleset), ctypes.c_int(1), ctypes.byref(rule), ctypes.c_uint32(0)):
            refuse(f"cannot add a Landlock rule for {path}")
        os.close(fd)
    if libc.prctl(38, 1, 0, 0, 0) or libc.syscall(446, ctypes.c_int(ruleset), ctypes.c_uint32(0)):
        refuse("cannot apply the Landlock ruleset")
for name, value in s["limits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
child = os.fork()
if child == 0:
    libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG: SIGKILL when the bootstrap dies (timeout kill)
    os.execv(sys.executable, [sys.executable, "-I", "-S", "-c", code])
_, status = os.waitpid(child, 0)
os._exit(os.waitstatus_to_exitcode(status) % 256 if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
"""


@dataclass(frozen=True)
class Limits:
    memory_mb: int = 512
    """Address space of each process."""
    cpu_s: int = 10
    """CPU seconds of each process."""
    processes: int = 16
    """Processes and threads (counted inside the sandbox's own user namespace)."""
    file_size_mb: int = 16
    """Largest file it may write (its output included)."""
    open_files: int = 64


DEFAULT_LIMITS = Limits()


@dataclass
class Result:
    stdout: str
    ok: bool
    error: str  # one line: what went wrong, empty when ok


def _readable() -> list[str]:
    """What the interpreter needs to start: its installation, system libraries, the loader cache."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    roots |= {str(Path(sys.executable).resolve().parent.parent)}
    roots |= {
        "/usr",
        "/lib",
        "/lib64",
        "/lib32",
        "/etc/ld.so.cache",
        "/etc/localtime",
        "/dev/null",
        "/dev/urandom",
    }
    return sorted(p for p in roots if os.path.exists(p))


def _rlimits(limits: Limits) -> dict[str, int]:
    mib = 2**20
    return {"RLIMIT_AS": limits.memory_mb * mib, "RLIMIT_CPU": limits.cpu_s, "RLIMIT_NPROC": limits.processes,
            "RLIMIT_FSIZE": limits.file_size_mb * mib, "RLIMIT_NOFILE": limits.open_files, "RLIMIT_CORE": 0}  # fmt: skip


def run_python(code: str, timeout_s: float, limits: Limits = DEFAULT_LIMITS, isolate: bool = True) -> Result:
    """Run ``code``; its stdout, or one line saying why it failed (exception, limit, timeout)."""
    with tempfile.TemporaryDirectory(prefix="rltrain-sandbox-") as tmp:
        workdir, logs = Path(tmp) / "work", Path(tmp) / "logs"
        workdir.mkdir()
        logs.mkdir()
        settings = {
            "isolate": isolate,
            "workdir": str(workdir),
            "readable": _readable(),
            "limits": _rlimits(limits),
        }
        with open(logs / "stdout", "w+b") as out, open(logs / "stderr", "w+b") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", BOOTSTRAP, json.dumps(settings), code],
                cwd=workdir, env={}, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                start_new_session=True, close_fds=True,
            )  # fmt: skip
            try:
                code_ = proc.wait(timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)
            stdout = _read(out, 64 * 1024)
            stderr = _read(err, 64 * 1024)
    if timed_out:
        return Result(stdout, False, f"timed out after {timeout_s:g}s")
    if code_ == 0:
        return Result(stdout, True, "")
    return Result(stdout, False, _why(code_, stderr, limits))


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _read(file, limit: int) -> str:
    file.seek(0)
    return file.read(limit).decode(errors="replace")


def _why(returncode: int, stderr: str, limits: Limits) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    if returncode == REFUSED and lines and lines[-1].startswith("sandbox:"):
        return lines[-1]
    if returncode > 128:
        sig = returncode - 128
        names = {signal.SIGXCPU: f"CPU time limit ({limits.cpu_s}s)",
                 signal.SIGXFSZ: f"file size limit ({limits.file_size_mb} MiB)"}  # fmt: skip
        return names.get(sig, f"killed by {signal.Signals(sig).name}")
    return lines[-1] if lines else f"exit code {returncode}"


@functools.cache
def isolation_problem() -> str | None:
    """None when :func:`run_python` can isolate on this machine, else why it cannot."""
    if not sys.platform.startswith("linux"):
        return f"isolation needs Linux (user/network namespaces and Landlock), this is {sys.platform}"
    result = run_python("import socket; socket.socket().connect(('127.0.0.1', 9))", 30, isolate=True)
    if result.error.startswith("sandbox:"):
        return result.error.removeprefix("sandbox: ")
    if result.ok or "Network is unreachable" not in result.error and "Errno 101" not in result.error:
        return f"the network stays reachable inside the sandbox ({result.error or 'connected'})"
    return None
