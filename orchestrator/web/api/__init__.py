"""The JSON API for scripts (the pages' data, same addresses under ``/api``), one module per
resource: :mod:`.runs` (runs, a run, its changes, its picture), :mod:`.actions` (operator
actions), :mod:`.bulk` (bulk actions), :mod:`.events` (emitting an event). Errors answer
``{"error": ..., "status": ...}``."""
