# One image for every macpool process: router, agent, simulator, demo, bench.
#   docker build -t macpool .   then   docker run --rm macpool router --help
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY macpool ./macpool
COPY router ./router
COPY node_agent ./node_agent
COPY simulator ./simulator
COPY bench ./bench
RUN pip install . && useradd --system --no-create-home macpool
USER macpool
ENTRYPOINT ["macpool"]
CMD ["--help"]
