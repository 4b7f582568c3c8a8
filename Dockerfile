# kda_rt OpenAI-compatible server: python:3.11-slim + CuPy and the CUDA 12 pip wheels it needs
# (runtime, NVRTC, cuBLAS).  No torch, no CUDA base image.  Needs an NVIDIA driver for CUDA 12 on
# the host (docker run --gpus all); without a GPU it serves on the NumPy backend.
#
#   docker build -t kda_rt .
#   docker run --gpus all -p 8000:8000 -v /models/Kimi-Linear-48B-A3B-Instruct:/model:ro kda_rt --model /model
#
# Estimated size (uncompressed) ~1.7 GB: see README "Serve" for how it was computed.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KDA_RT_CACHE_DIR=/var/cache/kda_rt/kernels \
    CUPY_CACHE_DIR=/var/cache/kda_rt/cupy \
    HOME=/home/kda

RUN useradd --create-home --uid 10001 --home-dir /home/kda kda \
 && mkdir -p /var/cache/kda_rt/kernels /var/cache/kda_rt/cupy \
 && chown -R kda:kda /var/cache/kda_rt

WORKDIR /opt/kda_rt
COPY setup.py setup.cfg pyproject.toml README.md ARCHITECTURE.md LICENSE ./
COPY kda_rt ./kda_rt
COPY loader ./loader
COPY sampler ./sampler
COPY kernels_cu ./kernels_cu

# A regular (non-editable) install builds the wheel, as `pip install kda_rt` would: every kda_rt.*
# package (kda_rt.cuda, kda_rt.cuda.ops, kda_rt.loader, kda_rt.sampler, ...) and the kernel sources.
# cuda-toolkit[...] pulls only the CUDA 12 wheels kda_rt uses (nvidia-cuda-runtime-cu12,
# nvidia-cuda-nvrtc-cu12, nvidia-cublas-cu12); CuPy finds them in site-packages.
RUN pip install --no-cache-dir ".[cuda12,server]" "cuda-toolkit[cublas,cudart,nvrtc]==12.*" \
 && rm -rf /opt/kda_rt/build /root/.cache \
 && python -c "import kda_rt.server, kda_rt.cuda, kda_rt.cuda.ops.compile as c, cupy, sys; assert 'torch' not in sys.modules; assert (c.KERNEL_DIR / 'mla_attn.cu').is_file()"

USER kda
WORKDIR /home/kda
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
  CMD python -c "import urllib.request, sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"
ENTRYPOINT ["python", "-m", "kda_rt.serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
