# The orchestrator image: one image for the migration, the workers, beat, the reconciler, serve and Flower
# (see docker-compose.yml). Configuration comes from ORCHESTRATOR_* environment variables.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    ORCHESTRATOR_DATA_DIR=/var/lib/orchestrator

WORKDIR /app

# the project: packaging metadata, the library, the task modules and the Celery app module
COPY pyproject.toml README.md ./
COPY orchestrator ./orchestrator
COPY tasks ./tasks
COPY config ./config

RUN pip install . \
    && useradd --system --uid 1000 --home-dir /var/lib/orchestrator orchestrator \
    && mkdir -p /var/lib/orchestrator \
    && chown orchestrator:orchestrator /var/lib/orchestrator

# Celery warns against running workers as root
USER orchestrator

CMD ["orchestrator", "worker"]
