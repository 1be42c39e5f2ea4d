"""The workers and their messages: live workers and the task names they registered, the
deployment's signing key, redelivered messages."""

from __future__ import annotations

import sqlalchemy as sa

from .base import TS, metadata

#: live Celery workers and what they can take: the dispatch window is their free capacity
workers = sa.Table(
    "orc_workers",
    metadata,
    sa.Column("name", sa.String(255), primary_key=True),
    sa.Column("queues", sa.JSON, nullable=False),
    sa.Column("concurrency", sa.Integer, nullable=False),
    sa.Column("started_at", TS, nullable=False),
    sa.Column("seen_at", TS, nullable=False),
    #: the code version the worker advertises (``ORCHESTRATOR_CODE_VERSION``, or a hash of its
    #: task modules); it also consumes ``QUEUE@VERSION`` for each of its queues (pinned runs)
    sa.Column("code_version", sa.String(64), nullable=True),
)

#: the task names each live worker registered, per queue it consumes (``task_name`` ``*``: a
#: worker that does not say, which takes every name): admission holds a READY task whose
#: (queue, task name) no row has (``orc_admit_from_v2``); a worker's rows go with its registry row
worker_tasks = sa.Table(
    "orc_worker_tasks",
    metadata,
    sa.Column("queue", sa.String(200), primary_key=True),
    sa.Column("task_name", sa.String(255), primary_key=True),
    sa.Column("worker", sa.String(255), primary_key=True),
)

secrets = sa.Table(
    "orc_secrets",
    metadata,
    #: ``signing_key``: the key of the fencing headers' signature (``protocol.sign``), made by
    #: migration 0005; every process that can reach the database reads it, the broker never sees it
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("value", sa.String(256), nullable=False),
)

deliveries = sa.Table(
    "orc_deliveries",
    metadata,
    #: redeliveries of one broker message (kept only for messages delivered again: a message
    #: whose pool process died comes back flagged ``redelivered``); past
    #: ``ORCHESTRATOR_MAX_REDELIVERIES`` it is parked (``inbox.GuardedConsumer``)
    sa.Column("message_id", sa.String(1024), primary_key=True),
    sa.Column("task_name", sa.String(1024), nullable=False),
    sa.Column("deliveries", sa.Integer, nullable=False),
    sa.Column("first_at", TS, nullable=False),
    sa.Column("last_at", TS, nullable=False),
    #: set when the message was parked, with the evidence (headers, body head, reason)
    sa.Column("parked_at", TS, nullable=True),
    sa.Column("evidence", sa.JSON, nullable=True),
)
