# One image for both roles of p2p-diloco: `docker run IMAGE peer ...` and `docker run IMAGE bootstrap ...`
# (the entrypoint is the `p2p-diloco` command). CPU-only by default; for NVIDIA GPUs build with e.g.
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t p2p-diloco:cuda .
# (any CUDA build of torch that the host's driver supports) and run it with `--gpus all`.
# State (checkpoints, identities, the corpus cache) belongs in the /data volume.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, from its own index: otherwise pip would resolve the project's torch requirement from PyPI
# and pull a multi-GB CUDA build into a CPU image. Its own layer, so code changes do not reinstall it.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /opt/p2p-diloco
COPY pyproject.toml README.md ./
COPY p2p_diloco ./p2p_diloco
# hivemind's wheel ships the p2pd daemon: nothing to compile.
RUN pip install . && rm -rf build

# An unprivileged user; /data and /shared are created here owned by it, so that named volumes mounted
# there start out writable for it (Docker copies ownership into a new, empty named volume).
RUN useradd --system --uid 10001 --create-home --home-dir /home/p2p --shell /usr/sbin/nologin p2p \
    && mkdir -p /data /shared \
    && chown p2p:p2p /data /shared
USER p2p
WORKDIR /data
VOLUME ["/data"]

# The bootstrap node's conventional port (bootstrap/bootstrap.toml); peers use any free port by default.
EXPOSE 31337

ENTRYPOINT ["p2p-diloco"]
CMD ["--help"]
