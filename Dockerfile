# retrofit on CUDA: PyTorch + flash-attn + flash-linear-attention + DeepSpeed + lm-eval.
#
#   docker build -t retrofit:cuda .
#   docker run --gpus all --rm -it --ipc=host \
#       -v "$HOME/.cache/huggingface:/cache/huggingface" -v "$HOME/.cache/retrofit:/cache/retrofit" \
#       -v "$PWD/runs:/workspace/runs" retrofit:cuda retrofit bench attention --device cuda --dtype bfloat16
#
# See docs/docker.md for the build arguments and more run lines.
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}

# flash-attn's setup fetches a prebuilt wheel matching torch / CUDA / the C++ ABI when one
# exists and compiles otherwise (then MAX_JOBS bounds its memory use: ~4 GB per job).
ARG FLASH_ATTN_VERSION=2.8.3
ARG MAX_JOBS=8
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    MPLBACKEND=Agg \
    HF_HOME=/cache/huggingface \
    RETROFIT_CACHE=/cache/retrofit \
    TRITON_CACHE_DIR=/cache/triton \
    MAX_JOBS=${MAX_JOBS}

RUN apt-get update \
 && apt-get install -y --no-install-recommends git ninja-build \
 && rm -rf /var/lib/apt/lists/*

# The slowest layer first, so that source edits do not rebuild it. --no-build-isolation:
# flash-attn builds against the image's torch; nothing here may replace that torch.
RUN python -m pip install packaging wheel setuptools psutil \
 && python -m pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"

WORKDIR /opt/retrofit
COPY pyproject.toml setup.py README.md LICENSE ./
COPY retrofit ./retrofit
COPY patches ./patches
COPY eval ./eval
COPY configs ./configs
COPY scripts ./scripts
# installed as a user installs it: the wheel (every package and the bundled books), not the source tree
RUN python -m pip wheel --no-deps --no-build-isolation -w /tmp/dist . \
 && python -m pip install --no-build-isolation "$(ls /tmp/dist/retrofit-*.whl)[gpu,train,eval]" \
 && rm -rf /tmp/dist \
 && python -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda); sys.exit(torch.version.cuda is None)"

# smoke test: the console script, every CLI verb's parser and the bundled catalogue load
RUN cd / && retrofit --help && retrofit bench --help && retrofit ls

RUN mkdir -p /cache/huggingface /cache/retrofit /cache/triton /workspace
VOLUME ["/cache"]
WORKDIR /workspace
CMD ["retrofit", "--help"]
