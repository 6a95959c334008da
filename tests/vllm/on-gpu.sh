#!/usr/bin/env bash
# tests/vllm on a machine with a GPU and vLLM installed (its `vllm` command on PATH, or SPECSERVE_VLLM set):
# the same end-to-end tests as on the CPU, unchanged. Run from the repository root after `make setup`.
set -euo pipefail
cd "$(dirname "$0")/../.."
command -v prometheus >/dev/null || { echo "tests/vllm needs Prometheus: make prometheus" >&2; exit 2; }
export SPECSERVE_VLLM="${SPECSERVE_VLLM:-vllm serve}"
exec .venv/bin/python -m pytest -q tests/vllm "$@"
