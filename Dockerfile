# collab volunteer image: `docker run IMAGE join --run-id RUN --initial-peers MADDR`. Two variants:
#
#   docker build -t collab .                          # CPU (the default target): torch's CPU wheel
#   docker build --target cuda -t collab:cuda .       # CUDA, for `docker run --gpus all collab:cuda ...`
#
# By default the CPU variant takes torch from PyTorch's CPU index and the CUDA variant from PyPI, whose Linux torch
# is the CUDA build. Both are build arguments, so the same file builds behind a mirror or offline:
#   --build-arg TORCH_INDEX_URL=URL     another index (empty: pip's configured index)
#   --build-arg TORCH_FIND_LINKS=DIR    also a local folder of wheels
# The variant is a target, not an ARG in FROM: podman 4.3 (Debian 12's) does not resolve a stage named through an ARG.

FROM python:3.11-slim AS base
# tini reaps hivemind's processes (p2pd included) and forwards `docker stop`'s SIGTERM to collab
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini=0.19.* \
    && rm -rf /var/lib/apt/lists/*
# the cache exists, owned by the volunteer, before it becomes a volume: a new volume copies it, else it is root's
RUN useradd --create-home --uid 10001 volunteer \
    && install -d -o volunteer -g volunteer /home/volunteer/.cache/collab
WORKDIR /opt/collab
ENV COLLAB_CACHE_DIR=/home/volunteer/.cache/collab PYTHONUNBUFFERED=1
# the peer's identity and checkpoints survive restarts if this is a volume
VOLUME ["/home/volunteer/.cache/collab"]
ENTRYPOINT ["tini", "--", "collab"]
CMD ["--help"]

# the sources in one layer, so that each variant copies them with one line after its torch
FROM scratch AS sources
COPY pyproject.toml README.md /opt/collab/
COPY collab /opt/collab/collab
COPY peers /opt/collab/peers
COPY dashboard /opt/collab/dashboard
COPY configs /opt/collab/configs

FROM base AS cuda
ARG TORCH_INDEX_URL=
ARG TORCH_FIND_LINKS=
# torch before the sources, so that editing collab does not download torch again.
# hadolint takes the optional flags for unpinned packages:
# hadolint ignore=DL3013
RUN pip install --no-cache-dir \
        ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} ${TORCH_FIND_LINKS:+--find-links "$TORCH_FIND_LINKS"} \
        torch==2.13.0 \
    && python -c "import sys, torch; sys.exit(torch.version.cuda is None and \
'this torch is a CPU build: set TORCH_INDEX_URL to an index of CUDA wheels')"
COPY --from=sources /opt/collab ./
# the README's second step; the torch above already satisfies collab's requirement
RUN pip install --no-cache-dir .
USER 10001

FROM base AS cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_FIND_LINKS=
# +cpu is pinned: from a general index a plain torch==2.13.0 is the CUDA build (2.7 GB of nvidia libraries).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir \
        ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} ${TORCH_FIND_LINKS:+--find-links "$TORCH_FIND_LINKS"} \
        torch==2.13.0+cpu
COPY --from=sources /opt/collab ./
RUN pip install --no-cache-dir .
USER 10001
