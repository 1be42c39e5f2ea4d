"""``celery -A config.celery_app worker|beat`` entry point: the project's app, configured
from ``ORCHESTRATOR_*`` environment variables (see orchestrator/core/config.py)."""

from orchestrator.celery_app import get_app

app = get_app()
