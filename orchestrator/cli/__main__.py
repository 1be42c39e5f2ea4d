"""``python -m orchestrator.cli``."""

from .app import main

main()
