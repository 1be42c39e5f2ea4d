"""Deployment configuration: the Celery app module for ``celery -A config.celery_app``."""
