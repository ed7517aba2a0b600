# parkq: one image for `parkq web` and `parkq worker`.
#   docker build --build-arg BACKEND=cpu  -t parkq:cpu  .
#   docker build --build-arg BACKEND=cuda -t parkq:cuda .   # llama.cpp with CUDA
# No secrets are baked in: Redis URL, password and API keys come from the environment.
# No model either: PARKQ_MODEL names a GGUF in a mounted volume.
ARG BACKEND=cpu
ARG CUDA_IMAGE_TAG=12.6.3

# ---- build stages: compile llama-cpp-python (with parkq's llama.cpp patches,
# tools/llamapatch) into a virtualenv ---------------------------------------
FROM python:3.11-slim-bookworm AS build-cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake git \
 && rm -rf /var/lib/apt/lists/*
ENV CMAKE_ARGS="-DGGML_NATIVE=OFF"

FROM nvidia/cuda:${CUDA_IMAGE_TAG}-devel-ubuntu24.04 AS build-cuda
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential cmake git \
 && rm -rf /var/lib/apt/lists/*
ENV CMAKE_ARGS="-DGGML_CUDA=on -DGGML_NATIVE=OFF"

# hadolint ignore=DL3006
FROM build-${BACKEND} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY scheduler ./scheduler
COPY jobs ./jobs
COPY web ./web
COPY tools ./tools
RUN python3 -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/venv/bin/python -m tools.llamapatch ensure \
 && /opt/venv/bin/pip install --no-cache-dir .

# ---- runtime stages ----------------------------------------------------------
FROM python:3.11-slim-bookworm AS runtime-cpu
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/*

FROM nvidia/cuda:${CUDA_IMAGE_TAG}-runtime-ubuntu24.04 AS runtime-cuda
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 libgomp1 \
 && rm -rf /var/lib/apt/lists/*

# hadolint ignore=DL3006
FROM runtime-${BACKEND}
COPY --from=build /opt/venv /opt/venv
RUN useradd --create-home --uid 10001 parkq \
 && mkdir -p /models /cache \
 && chown parkq /models /cache
USER 10001
WORKDIR /home/parkq
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PARKQ_HOST=0.0.0.0 \
    PARKQ_PORT=8000
EXPOSE 8000
ENTRYPOINT ["parkq"]
CMD ["web"]
