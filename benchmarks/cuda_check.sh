#!/usr/bin/env bash
# The embedded engine on a CUDA GPU against transformers' generate on the same GPU:
# what a new attention shape costs per SDPA backend (benchmarks/sdpa_new_shape.py), then
# benchmarks/engine_throughput.py (a pdserve preset copied into LlamaForCausalLM) in
# bfloat16 (transformers with PyTorch's default attention backends, then without cuDNN's,
# as the engine runs) and float32, with the greedy tokens of both sides compared.
#
#   benchmarks/cuda_check.sh [OUT_DIR]     # from the repository root; JSON results go to OUT_DIR
#
# Needs python3 with a CUDA build of torch and transformers. Wheels in .whl (pdserve's
# other imports: pydantic, protobuf, ...) are installed into a scratch directory first,
# for a machine that cannot reach a package index. Takes about 2 minutes on an H200.
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
'cudnn', torch.backends.cudnn.version(), 'transformers', transformers.__version__, \
torch.cuda.get_device_name(0))" || exit 1

echo "== one SDPA call, new shape against seen shape"
timeout 45 python3 benchmarks/sdpa_new_shape.py

throughput() {  # NAME ARGS...
  local name=$1; shift
  echo "== small, $name"
  timeout 100 python3 benchmarks/engine_throughput.py --device cuda --model small \
    --batch-sizes 1,8,32,128 --prompt-len 256 --new-tokens 64 --json "$OUT_DIR/$name.json" "$@" \
    2>&1 | grep -v "Loading weights\|Writing model shards"
}
throughput bfloat16 --dtype bfloat16
throughput bfloat16-hf-without-cudnn --dtype bfloat16 --hf-without-cudnn-attention
throughput float32 --dtype float32
