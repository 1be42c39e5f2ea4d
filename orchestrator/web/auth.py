"""Access control of ``orchestrator serve`` (``ORCHESTRATOR_UI_AUTH``): who may read and act.

Every read and write needs authentication, on any bind (only ``/healthz`` answers without it,
and says nothing but ``ok``). The setting is a comma-separated list of credentials, each
``user:password`` (HTTP basic) or a token of 16+ characters (``Authorization: Bearer TOKEN`` for
scripts; ``/login?token=TOKEN`` or the ``/login`` form for people: a signed session cookie),
optionally bound to a tenant with ``=TENANT`` (``=*`` or nothing: every tenant). A tenant-bound
credential acts as an orchestrator bound to that tenant: another tenant's run is 404
everywhere, lists and ``/metrics`` hold its tenant only. Unset, ``serve`` on a loopback address
makes a random token at start and prints its login URL (Jupyter's model); on any other address
it refuses to start. No request header (``Host``, ``X-Forwarded-For``, ...) grants or denies
anything: credentials decide. Wrong credentials, on every way in, are rate-limited per client
and in total (:class:`LoginLimiter`: 429 with ``Retry-After``; the total limit never refuses a
right credential); on a bind that is not loopback a basic-auth password needs
:data:`MIN_PASSWORD_CHARS` characters.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import tornado.web

from ..core.dag import TENANT_RE
from ..core.errors import ConfigurationError

#: the session cookie set by a token login (its value: the credential's name, signed)
SESSION_COOKIE = "orc_user"

#: a basic-auth password shorter than this is refused on a bind that is not loopback
MIN_PASSWORD_CHARS = 12


class LoginLimiter:
    """Wrong credentials, counted per client and in total (token buckets refilled over
    ``window`` seconds): every way a credential comes in (the login form, ``/login?token=``,
    ``Authorization: Bearer`` and ``Basic``) goes through :meth:`locked` before it is checked and
    :meth:`failed` when it was wrong.

    * A client (its address; an IPv6 client's /64 network) with ``per_client`` wrong attempts
      in the window is answered 429 with ``Retry-After`` before anything is checked, right or
      wrong: a guess from it says nothing. Other clients are not affected.
    * Past ``total`` wrong attempts in the window from all clients together, a wrong attempt
      is answered 429 (``Retry-After``) after ``delay`` seconds; a right credential still
      passes, so many guessing clients slow each other down but never lock the owner out.

    At most ``clients`` addresses are remembered (the ones with the fewest failures go first).
    ``clock`` is injected for tests. Used on the IO loop only (a lock keeps it safe anyway)."""

    def __init__(
        self,
        *,
        per_client: int = 10,
        total: int = 100,
        window: float = 60.0,
        delay: float = 1.0,
        clients: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.per_client, self.total, self.window, self.delay = per_client, total, window, delay
        self.clients = clients
        self.clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, at)
        self._all = (float(total), clock())
        self._lock = threading.Lock()

    @staticmethod
    def client_of(address: str | None) -> str:
        """The client an address counts as: itself, or an IPv6 address's /64 network (one
        host holds a whole /64)."""
        try:
            ip = ipaddress.ip_address(address or "")
        except ValueError:
            return address or "?"
        if isinstance(ip, ipaddress.IPv6Address):
            if ip.ipv4_mapped is not None:
                return str(ip.ipv4_mapped)
            return str(ipaddress.ip_network(f"{ip}/64", strict=False))
        return str(ip)

    def _refill(self, bucket: tuple[float, float], size: int, now: float) -> float:
        tokens, at = bucket
        return min(float(size), tokens + (now - at) * size / self.window)

    def _wait(self, tokens: float, size: int) -> float:
        return 0.0 if tokens >= 1 else max(1.0, (1 - tokens) * self.window / size)

    def locked(self, client: str) -> float:
        """Seconds until ``client`` may try a credential again (0: now)."""
        with self._lock:
            found = self._buckets.get(client)
            if found is None:
                return 0.0
            return self._wait(self._refill(found, self.per_client, self.clock()), self.per_client)

    def failed(self, client: str) -> float:
        """Count a wrong credential of ``client``; the seconds until the total budget has room
        again (0: it has)."""
        with self._lock:
            now = self.clock()
            found = self._buckets.pop(client, None)
            tokens = self._refill(found, self.per_client, now) if found else float(self.per_client)
            self._buckets[client] = (tokens - 1, now)  # the newest last
            if len(self._buckets) > self.clients:
                fullest = max(self._buckets, key=lambda c: self._refill(self._buckets[c], self.per_client, now))
                self._buckets.pop(fullest)
            had = self._refill(self._all, self.total, now)
            self._all = (max(had - 1, -float(self.total)), now)
            return self._wait(had, self.total)


class TooManyAttempts(tornado.web.HTTPError):
    """429: too many wrong credentials; ``retry_after`` seconds until the next try counts."""

    def __init__(self, retry_after: float, reason: str) -> None:
        super().__init__(429, reason=reason)
        self.retry_after = max(1, math.ceil(retry_after))


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (``127.0.0.1``, ``::1``, ``localhost``).
    An empty host, ``0.0.0.0`` and ``::`` listen on every interface: not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Credential:
    """One entry of ``ORCHESTRATOR_UI_AUTH``: a user's password (``basic``) or a token."""

    kind: str  # "basic" or "token"
    #: who acts, as the ledger records it: the user, or ``token`` / ``token@TENANT``
    name: str
    secret: str = field(repr=False)
    #: the tenant it sees and acts on; ``None``: every tenant (an admin)
    tenant: str | None = None


def _refuse(message: str) -> ConfigurationError:
    return ConfigurationError(f"ORCHESTRATOR_UI_AUTH {message}")


def parse_ui_auth(raw: str) -> tuple[Credential, ...]:
    """The credentials of ``ORCHESTRATOR_UI_AUTH``: comma-separated entries, each
    ``user:password`` or a token (16+ characters, no spaces), optionally followed by
    ``=TENANT`` (bound to that tenant) or ``=*`` (every tenant, as without ``=``). Spaces
    around entries are ignored; a secret containing ``=`` must end with ``=*`` or ``=TENANT``,
    and none may contain ``,``. Raises :class:`ConfigurationError` naming the bad entry by its
    position (and user), never echoing a secret."""
    if raw == "":
        return ()
    if not raw.strip():
        raise _refuse("is blank: set credentials, or leave it unset on a loopback bind")
    found: list[Credential] = []
    names: set[str] = set()
    for i, part in enumerate(raw.split(","), 1):
        entry = part.strip()
        where = f"entry {i}"
        if not entry:
            raise _refuse(f"{where} is empty (entries are separated by ',')")
        tenant: str | None = None
        if "=" in entry:
            entry, _, bound = entry.rpartition("=")
            bound = bound.strip()
            if bound != "*":
                if not TENANT_RE.fullmatch(bound):
                    raise _refuse(
                        f"{where}: what follows its last '=' is neither '*' nor a tenant name (1-64 letters,"
                        " digits, '_' or '-'); a secret containing '=' must end with =* or =TENANT"
                    )
                tenant = bound
        if ":" in entry:
            user, _, password = entry.partition(":")
            if not user.strip() or user != user.strip():
                raise _refuse(f"{where}: the user name is empty or has spaces around it")
            where += f" (user {user!r})"
            if not password.strip():
                raise _refuse(f"{where}: the password is blank")
            if user in names:
                raise _refuse(f"{where}: the user appears twice")
            found.append(Credential("basic", user, password, tenant))
            names.add(user)
        else:
            where += " (a token)"
            if not entry.strip():
                raise _refuse(f"{where}: the token is blank")
            if any(ch.isspace() for ch in entry):
                raise _refuse(f"{where}: a token has no spaces")
            if len(entry) < 16:
                raise _refuse(f"{where}: a token must be at least 16 characters")
            name = "token" if tenant is None else f"token@{tenant}"
            n = 1
            while name in names:
                n += 1
                name = ("token" if tenant is None else f"token@{tenant}") + f"#{n}"
            found.append(Credential("token", name, entry, tenant))
            names.add(name)
    return tuple(found)


def _same(given: str, secret: str) -> bool:
    return hmac.compare_digest(given.encode(), secret.encode())


class Access:
    """Who may read and act: the credentials of ``ORCHESTRATOR_UI_AUTH``; unset, a token made
    now on a loopback bind (:attr:`generated`), and a refusal on any other bind. On a bind that
    is not loopback a basic-auth password shorter than :data:`MIN_PASSWORD_CHARS` is refused
    too (:class:`ConfigurationError`, naming the entry and user, never the password)."""

    def __init__(self, auth: str, bind: str) -> None:
        self.credentials = parse_ui_auth(auth)
        self.local = is_loopback(bind)
        #: the token made at start when no credentials are configured (loopback only)
        self.generated = ""
        if not self.credentials:
            if not self.local:
                shown = bind or "0.0.0.0"
                raise ConfigurationError(
                    f"ORCHESTRATOR_UI_AUTH is not set: serve refuses to bind {shown} (not a loopback"
                    " address) without credentials"
                )
            self.generated = secrets.token_urlsafe(32)
            self.credentials = (Credential("token", "token", self.generated),)
        if not self.local:
            for i, c in enumerate(self.credentials, 1):
                if c.kind == "basic" and len(c.secret) < MIN_PASSWORD_CHARS:
                    raise _refuse(
                        f"entry {i} (user {c.name!r}): a password must be at least {MIN_PASSWORD_CHARS}"
                        f" characters when serve binds {bind or '0.0.0.0'} (not a loopback address)"
                    )
        self.by_name = {c.name: c for c in self.credentials}

    @property
    def has_basic(self) -> bool:
        return any(c.kind == "basic" for c in self.credentials)

    @property
    def has_token(self) -> bool:
        return any(c.kind == "token" for c in self.credentials)

    @property
    def tenants(self) -> set[str]:
        return {c.tenant for c in self.credentials if c.tenant is not None}

    def basic(self, header: str) -> Credential | None:
        """The credential of a valid ``Authorization: Basic`` header."""
        if not header.startswith("Basic "):
            return None
        try:
            user, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        found = None
        for c in self.credentials:  # every entry compared: the time says nothing of which matched
            if c.kind == "basic" and _same(user, c.name) & _same(password, c.secret):
                found = c
        return found

    def token(self, given: str) -> Credential | None:
        """The credential of a token (from a Bearer header, ``/login?token=`` or the form)."""
        found = None
        for c in self.credentials:
            if c.kind == "token" and _same(given, c.secret):
                found = c
        return found if given else None

    def bearer(self, header: str) -> Credential | None:
        return self.token(header[7:].strip()) if header.startswith("Bearer ") else None


def safe_next(target: str) -> str:
    """Where the login form may send the browser: a path of this app, nothing else."""
    parts = urlsplit(target)
    if (
        not target.startswith("/")
        or target.startswith("//")
        or "\\" in target
        or any(ord(ch) < 0x20 for ch in target)
        or parts.scheme
        or parts.netloc
    ):
        return "/runs"
    return target
