"""Who acts, and what they may change: the checks the facade and its sub-objects share (a
tenant-bound orchestrator changes its own tenant's settings only, and nothing deployment-wide),
and the default ``by`` of operator actions."""

from __future__ import annotations

import getpass
import socket
from typing import TYPE_CHECKING, Protocol

from ..core.dag import TENANT_RE
from ..core.errors import ValidationError
from ..core.routing import DEFAULT_TENANT

if TYPE_CHECKING:
    from ..core.config import Settings
    from ..core.models import RunView
    from ..core.publisher import Publisher
    from ..services.triggers import Triggers
    from ..store import Store


class Host(Protocol):
    """What a sub-object (``orc.limits``, ``orc.breakers``, ``orc.tenants``, ``orc.events``) uses of
    the :class:`~orchestrator.engine.Orchestrator` it belongs to."""

    tenant: str | None
    settings: Settings
    publisher: Publisher

    @property
    def store(self) -> Store: ...

    @property
    def triggers(self) -> Triggers: ...

    def visible(self, run_id: str) -> RunView: ...


def tenant_name(name: object) -> str:
    """``name`` checked as a tenant name; raises :class:`ValidationError`."""
    if not isinstance(name, str) or not TENANT_RE.fullmatch(name):
        raise ValidationError(f"tenant {name!r} must be 1-64 letters, digits, '_' or '-'")
    return name


def own_tenant(bound: str | None, name: str) -> None:
    """Refuse (:class:`ValidationError`) a malformed tenant name, or another tenant's settings
    from an orchestrator bound to the tenant ``bound``."""
    tenant_name(name)
    if bound is not None and name != bound:
        raise ValidationError(f"this orchestrator acts as tenant {bound!r}; it cannot change tenant {name!r}")


def deployment_wide(bound: str | None, what: str) -> None:
    """Refuse (:class:`ValidationError`) a change of a deployment-wide setting from an
    orchestrator bound to a tenant."""
    if bound is not None:
        raise ValidationError(
            f"{what} are deployment-wide: this orchestrator acts as tenant {bound!r} and cannot change them"
        )


def acting_tenant(bound: str | None, asked: str | None, action: str) -> str:
    """The tenant an action acts for: a bound orchestrator's own (another is refused with
    :class:`ValidationError`, the default tenant standing for its own), else ``asked`` or the
    default tenant."""
    if bound is not None:
        if asked is not None and asked not in (bound, DEFAULT_TENANT):
            raise ValidationError(f"this orchestrator acts as tenant {bound!r}; it cannot {action} for {asked!r}")
        return bound
    return tenant_name(asked or DEFAULT_TENANT)


def os_user() -> str:
    """Who runs this process (the ``by`` of operator actions that do not name anyone)."""
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no user database entry (containers): still act, unnamed
        return "unknown"


def local_by(via: str | None = None) -> str:
    """Who acts from this process, and from where: ``user@host``, with ``(via)`` when given
    (the CLI records ``alice@ops-1 (cli)``); the default ``by`` of operator actions."""
    where = f"{os_user()}@{socket.gethostname()}"
    return f"{where} ({via})" if via else where
