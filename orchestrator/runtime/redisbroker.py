"""Redis as the broker: kombu's Redis transport, with one client object per channel.

kombu's Redis channel builds a new ``redis.Redis`` client object for every publish, every
acknowledgement and every queue-size check (``conn_or_acquire``: a client over the channel's
connection pool, its response-callback table filled anew each time): about a third of a lean
publish's cost (``bench/publish.py``). Here a channel keeps one such client over its pool and
makes a new one only when the pool was replaced (after a reconnection). The connections, the
commands and the message format are kombu's. ``celery_app`` registers this transport for
``redis://`` and ``rediss://`` URLs.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis

#: what ``redis://`` and ``rediss://`` resolve to once :func:`register` ran
TRANSPORT = "orchestrator.runtime.redisbroker:Transport"


class Channel(kombu_redis.Channel):
    _orc_client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:
            return super()._create_client(asynchronous=True)
        client = self._orc_client
        if client is None or client.connection_pool is not self.pool:
            client = self._orc_client = super()._create_client()
        return client


class Transport(kombu_redis.Transport):
    Channel = Channel


def register() -> None:
    """Make ``redis://`` and ``rediss://`` URLs use this transport (idempotent)."""
    TRANSPORT_ALIASES["redis"] = TRANSPORT
    TRANSPORT_ALIASES["rediss"] = TRANSPORT
