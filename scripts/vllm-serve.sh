#!/usr/bin/env bash
# Starts one vLLM server (CPU) from .venv-vllm on the SmolLM2 checkpoint that
# scripts/vllm-env.sh writes, as pdserve's vLLM backend drives it (docs/vllm.md):
#
#   scripts/vllm-serve.sh ROLE PORT [vLLM args...]
#
# ROLE: hybrid (no KV connector), prefill (NixlConnector kv_producer) or decode
# (kv_consumer). Environment: VLLM_CPU_OMP_THREADS_BIND (cores, e.g. "0" or "0-1";
# default "nobind"), VLLM_CPU_KVCACHE_SPACE (GiB, default 1), NIXL_PORT (the NIXL
# side channel, default PORT+1000), PDSERVE_VLLM_MODEL_DIR, VLLM_VENV.
set -euo pipefail
cd "$(dirname "$0")/.."
ROLE=${1:?role: hybrid|prefill|decode}
PORT=${2:?port}
shift 2
VENV=${VLLM_VENV:-.venv-vllm}
MODEL_DIR=${PDSERVE_VLLM_MODEL_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pdserve/vllm/smollm2-f32}

case "$ROLE" in
  hybrid) KV=() ;;
  prefill) KV=(--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"cpu"}') ;;
  decode) KV=(--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_buffer_device":"cpu"}') ;;
  *) echo "unknown role $ROLE" >&2; exit 2 ;;
esac

export VLLM_TARGET_DEVICE=cpu
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
export VLLM_NIXL_SIDE_CHANNEL_PORT=${NIXL_PORT:-$((PORT + 1000))}
export VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1
# tcmalloc (Debian's libtcmalloc-minimal4) and the Intel OpenMP runtime vllm-cpu ships.
export LD_PRELOAD="/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:$PWD/$VENV/lib/libiomp5.so${LD_PRELOAD:+:$LD_PRELOAD}"

exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server \
  --model "$MODEL_DIR" --served-model-name smollm2 --dtype float32 \
  --host 127.0.0.1 --port "$PORT" --max-model-len 2048 \
  --enable-per-request-metrics --enable-prompt-tokens-details \
  "${KV[@]}" "$@"
