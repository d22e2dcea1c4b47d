# ndtrain on CUDA GPUs: the image the Kubernetes examples run (examples/kubernetes/*.yaml).
#
#   docker build -t ndtrain:0.1.0 .
#   docker tag ndtrain:0.1.0 <your-registry>/ndtrain:0.1.0 && docker push <your-registry>/ndtrain:0.1.0
#
# Python and torch are the versions pyproject.toml pins (tests/tools/test_container.py checks it).
# On Linux x86_64 the torch wheel from the package index is the CUDA build: it carries the CUDA
# runtime, cuDNN and NCCL as its own dependencies, so the base needs no CUDA toolkit; the node's
# NVIDIA driver comes in through the NVIDIA container runtime (the GPU device plugin on Kubernetes).
ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim-bookworm

ARG TORCH_VERSION=2.13.0
# libibverbs + the providers and rdmacm: NCCL's InfiniBand/RoCE transport loads them at run time;
# without them multi-node NCCL silently falls back to TCP sockets (several times slower).
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers librdmacm1 procps \
 && rm -rf /var/lib/apt/lists/*

# TORCH_DISABLE_SHARE_RDZV_TCP_STORE: torchrun restarts need a rendezvous store per attempt
# (docs/launch.md).
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

WORKDIR /opt/ndtrain
# torch first, in its own layer: it is most of the image and changes least often.
RUN pip install "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY src ./src
COPY configs ./configs
RUN pip install . && python -c "import ndtrain, torch; print('ndtrain on torch', torch.__version__)"

# No ENTRYPOINT: the Kubernetes examples run `torchrun ... -m ndtrain train`; under a container
# runtime that makes torchrun PID 1, which ndtrain's workers handle (docs/launch.md, "Containers").
CMD ["ndtrain", "--help"]
