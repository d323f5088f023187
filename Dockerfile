# collab volunteer image: `docker run IMAGE join --run-id RUN --initial-peers MADDR`
FROM python:3.11-slim

# tini reaps hivemind's processes (p2pd included) and forwards `docker stop`'s SIGTERM to collab
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini=0.19.* \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/collab
COPY pyproject.toml README.md ./
COPY collab ./collab
COPY peers ./peers
COPY dashboard ./dashboard
COPY configs ./configs

# the same two steps as the README: torch first (CPU build), then the project
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir .

RUN useradd --create-home --uid 10001 volunteer
USER 10001
ENV COLLAB_CACHE_DIR=/home/volunteer/.cache/collab PYTHONUNBUFFERED=1
# the peer's identity and checkpoints survive restarts if this is a volume
VOLUME ["/home/volunteer/.cache/collab"]

ENTRYPOINT ["tini", "--", "collab"]
CMD ["--help"]
