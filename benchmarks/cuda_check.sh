#!/usr/bin/env bash
# The embedded engine on a CUDA GPU against transformers' generate on the same GPU:
# benchmarks/engine_throughput.py (a pdserve preset copied into LlamaForCausalLM) in
# float32 and bfloat16, with the greedy tokens of both sides compared.
#
#   benchmarks/cuda_check.sh [OUT_DIR]     # from the repository root
#
# Needs python3 with a CUDA build of torch and transformers. Wheels in .whl (pdserve's
# other imports: pydantic, protobuf, ...) are installed into a scratch directory first,
# for a machine that cannot reach a package index.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-/tmp/pdserve-cuda-check}}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/pdserve-site .whl/*.whl || exit 1
  export PYTHONPATH=$PWD:/tmp/pdserve-site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, torch.cuda.get_device_name(0))" || exit 1
for dtype in float32 bfloat16; do
  echo "== small, $dtype"
  timeout 240 python3 benchmarks/engine_throughput.py --device cuda --dtype "$dtype" --model small \
    --batch-sizes 1,8,32,128 --prompt-len 256 --new-tokens 64 2>&1 | grep -v "Loading weights" \
    | tee "$OUT_DIR/throughput-$dtype.log"
done
