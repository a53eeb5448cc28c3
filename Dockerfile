# syntax=docker/dockerfile:1
# kvserve image: one image for every role (router, prefill, decode, store);
# the container's args pick the subcommand. Model weights are not baked in:
# an init container runs `kvserve model fetch` into a volume ($KVSERVE_CACHE).
#
#   CPU:  docker build -t kvserve:0.1.0 .
#   CUDA: docker build -t kvserve-cuda:0.1.0 \
#           --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/<cuda tag> .
#         (<cuda tag> such as cu128 or cu130: pick the one your driver supports)

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# A C compiler builds the native block-hash extension (there is a pure-Python
# fallback, but the image should ship the fast path).
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/kvserve
ENV PATH=/opt/kvserve/bin:$PATH
# torch first, from the chosen wheel index (CPU by default): resolving it from
# the default index would pull a multi-GB CUDA build into a CPU image.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY . /src
# [otel]: request traces over OTLP when OTEL_EXPORTER_OTLP_* is set (docs/operators.md).
RUN pip install "/src[otel]" && rm -rf /src

FROM ${PYTHON_IMAGE} AS runtime
RUN groupadd --gid 10001 kvserve \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kvserve \
 && install -d -o 10001 -g 10001 /models
COPY --from=build /opt/kvserve /opt/kvserve
# The pods run with a read-only root filesystem: everything writable is a
# volume (/tmp, /models, the store's /dev/shm and G3).
ENV PATH=/opt/kvserve/bin:$PATH \
    HOME=/tmp \
    MPLCONFIGDIR=/tmp/matplotlib \
    KVSERVE_CACHE=/models \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8000 50051 50052 50053 50054 9100
ENTRYPOINT ["kvserve"]
CMD ["--help"]
