# One image for every macpool process: router, agent, simulator, demo, bench.
#   docker build -t macpool .   then   docker run --rm macpool router --help
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY macpool ./macpool
COPY router ./router
COPY node_agent ./node_agent
# the versions constraints.txt locks (`macpool dev lock` writes it)
RUN pip install -c constraints.txt . && useradd --system --no-create-home --uid 10001 macpool
# numeric, so a cluster enforcing runAsNonRoot (the "restricted" pod security standard) can verify it
USER 10001
ENTRYPOINT ["macpool"]
CMD ["--help"]
