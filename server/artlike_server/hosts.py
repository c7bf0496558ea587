"""Which names a request may address this server by: the defence against DNS rebinding.

A web page at `http://rebind.example:8000` can re-point its own name at 127.0.0.1. The browser then sends
the page's requests to this server and counts them as the page's own origin: the `Origin` check passes and
the page reads every answer. Such requests still carry the page's name in `Host`, so a server that answers
only the names it knows defeats it.

Allowed without asking: loopback (`localhost`, 127.0.0.0/8, `[::1]`) and any IP address (a rebinding page's
URL holds a name, never an address, so an address in `Host` is one the client dialled: a load balancer's
probe, a client on the LAN), with any port. Anything else must be listed: `artlike serve --allowed-hosts
NAME` (the `--host` name is listed by itself); `*` allows every name. A request without `Host` (HTTP/1.0)
does not come from a browser and is allowed.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["ALLOW_ANY", "DEFAULT_HOSTS", "HostPolicy", "host_name", "is_loopback_name"]

ALLOW_ANY = "*"
_LOOPBACK_NAMES = frozenset({"localhost"})
# `name[:port]` or `[ipv6][:port]`; the name may end in a dot (the absolute form of a DNS name).
_HOST = re.compile(r"(?:\[(?P<ipv6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9_](?:[a-z0-9_.-]*[a-z0-9_.])?))(?::[0-9]{1,5})?")


def host_name(header: bytes | str) -> str | None:
    """The host of a `Host` header value, lower case, without brackets, port or trailing dot; None when it is
    not one (an unbracketed IPv6 address, spaces, an empty name)."""
    text = (header.decode("latin-1") if isinstance(header, bytes) else header).strip().lower()
    match = _HOST.fullmatch(text)
    if match is None:
        return None
    if match["ipv6"] is not None:
        try:
            return str(ipaddress.IPv6Address(match["ipv6"]))
        except ValueError:
            return None
    name = match["name"].rstrip(".")
    return name if name and ".." not in name else None


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback_name(name: str) -> bool:
    """Whether a host (as `host_name` returns it) is loopback by its spelling alone: nothing is resolved."""
    if name in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class HostPolicy:
    """The names a request's `Host` may carry besides loopback and IP addresses (`any_host`: every name)."""

    names: frozenset[str] = frozenset()
    any_host: bool = False

    @classmethod
    def from_options(cls, allowed: Iterable[str], bind_host: str | None = None) -> HostPolicy:
        """From `--allowed-hosts` values (each may hold several, split by commas or spaces) and `--host`.

        Raises ValueError naming an entry that is not a host name."""
        names: set[str] = set()
        any_host = False
        for value in allowed:
            for entry in value.replace(",", " ").split():
                if entry == ALLOW_ANY:
                    any_host = True
                    continue
                name = host_name(entry)
                if name is None:
                    raise ValueError(f"not a host name: {entry!r} (e.g. studio.example.com, or * for any)")
                names.add(name)
        if bind_host and not _is_address(bind_host.strip("[]")):  # addresses are allowed anyway
            bound = host_name(bind_host)
            if bound is not None:
                names.add(bound)
        return cls(frozenset(names), any_host)

    def allows(self, headers: Sequence[bytes]) -> bool:
        """Whether a request with these `Host` header values may be answered (several: none is trusted)."""
        if self.any_host or not headers:
            return True
        if len(headers) > 1:
            return False
        name = host_name(headers[0])
        return name is not None and (name in self.names or is_loopback_name(name) or _is_address(name))


DEFAULT_HOSTS = HostPolicy()
"""Loopback names and IP addresses only."""
