"""Task modules registered in the project's Celery app (``ORCHESTRATOR_TASK_MODULES``)."""
