"""``orchestrator serve``: the web UI, its JSON API and /metrics."""

from __future__ import annotations

import click

from . import base


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0: every interface).")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(1, 65535))
@click.option(
    "--behind-tls-proxy", is_flag=True, default=None,
    help="A proxy in front terminates TLS: cookies are Secure (default: ORCHESTRATOR_UI_BEHIND_TLS_PROXY).",
)  # fmt: skip
def serve(host: str, port: int, behind_tls_proxy: bool | None) -> None:
    """Serve the web UI, its JSON API and Prometheus /metrics, from the database.

    Runs at /runs (filters: tenant, DAG, state), a run with its DAG drawn at /runs/RUN_ID, its
    JSON at /api/runs/RUN_ID, metrics at /metrics. Every page, JSON document, action and
    /metrics needs a credential of ORCHESTRATOR_UI_AUTH (user:password for basic auth, or a
    token; =TENANT binds one to a tenant). Unset, a loopback bind makes a token at start and
    prints its login URL; any other bind refuses to start (exit 2), as it refuses a basic-auth
    password shorter than 12 characters. Wrong credentials are rate-limited (429)."""
    from ..web.app import Access
    from ..web.app import serve as run_server

    orc = base._orc()
    Access(orc.settings.ui_auth, host)  # refuse a bad or missing credential before opening the database
    orc.ready()
    try:
        run_server(
            orc, host=host, port=port, auth=orc.settings.ui_auth, ready=lambda line: click.echo(line, err=True),
            behind_tls_proxy=behind_tls_proxy or None,
        )  # fmt: skip
    except KeyboardInterrupt:
        pass
