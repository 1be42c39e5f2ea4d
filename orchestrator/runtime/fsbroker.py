"""The embedded default's broker: kombu's filesystem transport, with an atomic publish.

kombu's filesystem transport creates a message's file and then writes it, while a consumer
renames any file of its queue away and reads it: a consumer that comes between the two reads an
empty file, and the worker stops on the ``JSONDecodeError`` ("Unrecoverable error"). Here a
message is written under a name no consumer matches and then renamed into place, which is
atomic on one filesystem. ``celery_app`` registers this transport for ``filesystem://`` URLs.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

#: what ``filesystem://`` resolves to once :func:`register` ran
TRANSPORT = "orchestrator.runtime.fsbroker:Transport"


class Channel(filesystem.Channel):
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        """Put ``payload`` onto ``queue``: written whole under a hidden name, then renamed to
        the name consumers look for (``<ms>_<uuid>.<queue>.msg``)."""
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        # ".<uuid>.part": its text after the first dot never ends in ".<queue>.msg"
        temp = os.path.join(self.data_folder_out, f".{uuid.uuid4()}.part")
        try:
            with open(temp, "wb", buffering=0) as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(temp, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel


def register() -> None:
    """Make ``filesystem://`` URLs use this transport (idempotent)."""
    TRANSPORT_ALIASES["filesystem"] = TRANSPORT
