# workerpool worker image. Configure with flags, WORKERPOOL_* variables or a mounted
# workerpool.toml; credentials come from the runtime (workload identity), never from the image.
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

RUN useradd --create-home --uid 10001 workerpool
WORKDIR /app
COPY pyproject.toml README.md ./
COPY workerpool ./workerpool
COPY jobs ./jobs
RUN pip install . && chown -R workerpool:workerpool /app

USER workerpool
# Kubernetes and Cloud Run send SIGTERM; the worker drains on it and exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["workerpool", "run"]
