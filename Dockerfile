# syntax=docker/dockerfile:1
# Three images from one file (docs/images.md; `make images` builds and tags them):
#   --target runtime      vLLM's OpenAI image + specserve + the bundled drafters   ghcr.io/specserve/runtime
#   --target runtime-cpu  the embedded PyTorch engine (CPU) + the bundled drafters  ghcr.io/specserve/runtime-cpu
#   --target operator     the kopf operator, no torch                               ghcr.io/specserve/operator
# Bases are pinned by exact tag. The bundled drafters travel in the wheel (package data), where the runtime
# resolves `draftModel: bundled://NAME` (tests/operator/test_images.py keeps the images, the operator and the
# chart in agreement).

# The project wheel, built once: no build tools reach the final stages.
FROM python:3.11.7-slim-bookworm AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY runtime ./runtime
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# The engine's kernels (block-quantised matrix products, row-exact attention, the target's decoder layers:
# blockquant.py), built once on the
# full Python image, which has gcc: its name and flags are blockquant's own (tests/operator/test_images.py).
# No -march: the library picks AVX-512 or AVX2 per CPU at run time, so it runs on any x86-64 node.
FROM python:3.11.7-bookworm AS kernels
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY runtime/specserve_runtime/kernels.h runtime/specserve_runtime/blockquant.c runtime/specserve_runtime/attention.c runtime/specserve_runtime/decoder.c /src/
RUN mkdir /kernels && gcc -O3 -fopenmp -shared -fPIC -o "/kernels/blockquant-$(cat /src/kernels.h /src/blockquant.c /src/attention.c /src/decoder.c | sha256sum | cut -c1-16).so" /src/blockquant.c /src/attention.c /src/decoder.c

FROM python:3.11.7-slim-bookworm AS operator
ARG SPECSERVE_VERSION=0.1.0
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin specserve
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir "specserve[operator] @ file:///wheels/specserve-${SPECSERVE_VERSION}-py3-none-any.whl"
USER 10001
ENTRYPOINT ["specserve"]
CMD ["operator", "--all-namespaces"]

FROM python:3.11.7-slim-bookworm AS runtime-cpu
ARG SPECSERVE_VERSION=0.1.0
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin specserve
# torch from PyTorch's CPU index: the PyPI wheel would bring gigabytes of CUDA libraries.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu \
        "torch==2.13.0+cpu" "specserve[runtime] @ file:///wheels/specserve-${SPECSERVE_VERSION}-py3-none-any.whl"
COPY --from=kernels /kernels/ /opt/specserve/kernels/
ENV SPECSERVE_CACHE=/cache HF_HOME=/cache/huggingface SPECSERVE_KERNELS=/opt/specserve/kernels
USER 10001
EXPOSE 8000
ENTRYPOINT ["specserve"]
CMD ["launch", "--config", "/etc/specserve/runtime.yaml"]

FROM vllm/vllm-openai:v0.34.0 AS runtime
ARG SPECSERVE_VERSION=0.1.0
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin specserve
# vLLM's image already has torch (CUDA), vLLM and what `specserve launch` imports (pydantic,
# pyyaml): the wheel alone, so that nothing replaces the versions vLLM was built against.
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-deps "/wheels/specserve-${SPECSERVE_VERSION}-py3-none-any.whl"
ENV SPECSERVE_CACHE=/cache HF_HOME=/cache/huggingface
USER 10001
EXPOSE 8000
ENTRYPOINT ["specserve"]
CMD ["launch", "--config", "/etc/specserve/runtime.yaml"]
