"""Calls one yaied daemon forwards to another (a remote engine), and the loops they must not make.

A daemon that lists itself as a remote engine, or two that list each other, would pass a call
round until their connections run out. Three checks keep that from happening:

- **its own address**: a remote engine whose URL is the daemon's own port on a loopback name, or
  on the host it binds, is refused when the config loads (``is_own_address``);
- **its own instance**: every daemon answers every request with ``X-Yaied-Instance``, a random
  id of its own; a remote engine that answers with the router's own id is the router itself
  (another name for this machine, a proxy in between), and is refused;
- **the hops**: a forwarded call carries ``X-Yaied-Via``, the ids of the daemons it has passed
  through; a daemon that finds its own id there (A -> B -> A), or more than MAX_HOPS ids,
  answers 508 Loop Detected, and the daemon that forwarded it sends the call elsewhere.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

INSTANCE_HEADER = "X-Yaied-Instance"
VIA_HEADER = "X-Yaied-Via"
LOOP_CODE = "forwarding_loop"  # the error code of a 508 for a call that came round again
MAX_HOPS = 8  # daemons a call may pass through, however they are chained
_MAX_VIA_CHARS = 1024  # of the header: MAX_HOPS ids and their commas, with room to spare
_ANY_HOST = ("", "0.0.0.0", "::")  # a daemon bound to every address


def parse_via(value: str | None) -> tuple[str, ...]:
    """The instance ids in an ``X-Yaied-Via`` header, in order (empty ones dropped)."""
    if not value:
        return ()
    return tuple(part.strip() for part in value[:_MAX_VIA_CHARS].split(",") if part.strip())


def loop_in(via: tuple[str, ...], instance_id: str) -> str | None:
    """Why a call that passed through ``via`` must not be served by ``instance_id``, or None."""
    if instance_id in via:
        path = " -> ".join((*via, instance_id))
        return f"forwarding loop: this call came back to daemon {instance_id} ({path})"
    if len(via) > MAX_HOPS:
        return f"forwarding loop: this call passed through {len(via)} daemons already"
    return None


def is_loopback(host: str) -> bool:
    """A loopback address or name: 127.0.0.0/8, ::1, localhost (and its subdomains)."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_own_address(url: str, host: str, port: int) -> bool:
    """Whether ``url`` surely reaches a daemon bound to ``host``:``port`` (on this machine): the
    same port, and the host it binds, a loopback name where it binds loopback or every address,
    or a loopback (or unspecified) address of the family it binds. Another loopback address
    than the one it binds (127.0.0.2 beside 127.0.0.1), or the other family, may be another
    daemon's; names not told here are told by the instance id (see above)."""
    parts = urlsplit(url)
    name = (parts.hostname or "").lower().rstrip(".")
    try:
        url_port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return False
    if port <= 0 or url_port != port:
        return False
    bound = host.strip("[]").lower().rstrip(".")
    if name == bound:
        return True
    if name == "localhost" or name.endswith(".localhost"):
        return bound in _ANY_HOST or is_loopback(bound)
    address, bound_address = _ip(name), _ip(bound)
    if address is None or not (address.is_loopback or address.is_unspecified):
        return False
    if bound in _ANY_HOST:  # "" binds both families; 0.0.0.0 and :: their own
        return bound == "" or address.version == (6 if bound == "::" else 4)
    # 0.0.0.0 as a destination is this machine's loopback of that family
    return (
        bound_address is not None
        and bound_address.is_loopback
        and address.is_unspecified
        and address.version == bound_address.version
    )


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None
