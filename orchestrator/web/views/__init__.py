"""The pages, server-rendered from ``web/templates`` (no build step, nothing from a CDN), one
module per page: :mod:`.runs` (the runs list), :mod:`.run` (the run page, its drawing, its
script and its forms), :mod:`.login` (login and logout), :mod:`.monitor` (``/healthz``,
``/metrics``), :mod:`.error` (any other address)."""
