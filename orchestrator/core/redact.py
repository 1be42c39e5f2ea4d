"""Secrets never printed (pure code): URLs with credentials shown without them.

Broker and database URLs carry a password in their user part; webhook URLs usually carry
their secret in the path or the query (Slack, Teams, PagerDuty). Everything the orchestrator
prints or logs about a URL goes through :func:`url` or :func:`webhook`.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

_SECRET_PARAM = re.compile(r"pass|pwd|secret|token|key|auth|sig|credential", re.IGNORECASE)


def url(value: str) -> str:
    """``value`` with the password of its user part and secret-looking query values as ``***``."""
    try:
        parts = urlsplit(value)
    except ValueError:
        return "<unparsable URL>"
    netloc = parts.netloc
    if "@" not in netloc and not (parts.query and _SECRET_PARAM.search(parts.query)):
        return value  # nothing to hide (urlunsplit would not give back embedded:///path or filesystem://)
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{host}" if ":" in userinfo else f"{user}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if _SECRET_PARAM.search(k) else v) for k, v in pairs], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def webhook(value: str) -> str:
    """Only the scheme and host of a webhook URL (its path and query are its secret)."""
    try:
        parts = urlsplit(value)
        host = parts.hostname or "?"
    except ValueError:
        return "<unparsable URL>"
    return f"{parts.scheme}://{host}/…"
