"""The embedded broker's publish is atomic: a consumer polling the folder while another process
publishes never reads a message half written (kombu's own filesystem transport can, and the
worker then stops on a JSONDecodeError: seen once in CI as the demo's worker dying)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

from kombu import Connection

from orchestrator.runtime import fsbroker

N = 3000


def _options(folder: Path) -> dict[str, Any]:
    return {"data_folder_in": str(folder), "data_folder_out": str(folder), "polling_interval": 0}


def _publish(transport: str, folder: str, n: int) -> None:
    with Connection(transport=transport, transport_options=_options(Path(folder))) as conn:
        channel = conn.default_channel
        for i in range(n):
            channel._put("q", {"body": "x" * 20_000, "i": i})


def pump(transport: str, folder: Path, n: int = N) -> tuple[int, list[str]]:
    """Publish ``n`` messages from another process while this one consumes: (read, errors)."""
    producer = multiprocessing.get_context("fork").Process(target=_publish, args=(transport, str(folder), n))
    got, errors = 0, []
    with Connection(transport=transport, transport_options=_options(folder)) as conn:
        channel = conn.default_channel
        producer.start()
        try:
            while got < n and (producer.is_alive() or any(folder.glob("*.q.msg"))):
                try:
                    channel._get("q")
                    got += 1
                except Exception as exc:  # noqa: BLE001 - Empty, or a half-written message
                    if type(exc).__name__ != "Empty":
                        errors.append(repr(exc))
        finally:
            producer.join(60)
    return got, errors


def test_every_message_is_read_whole(tmp_path: Path) -> None:
    got, errors = pump(fsbroker.TRANSPORT, tmp_path)
    assert errors == [] and got == N


def test_filesystem_urls_use_it_once_registered() -> None:
    from kombu.transport import TRANSPORT_ALIASES, resolve_transport

    fsbroker.register()
    assert TRANSPORT_ALIASES["filesystem"] == fsbroker.TRANSPORT
    assert resolve_transport("filesystem") is fsbroker.Transport
