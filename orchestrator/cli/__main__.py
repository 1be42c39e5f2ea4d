"""``python -m orchestrator.cli``."""

from . import main

main()
