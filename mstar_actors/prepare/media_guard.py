"""Which hosts a media fetch may reach: no server-side request forgery.

A client names an ``http(s)`` URL and the server fetches it, from inside
the operator's network. So by default a fetch may reach only public
addresses: never loopback, link-local (cloud metadata lives there),
private (RFC 1918, IPv6 unique-local, shared and other non-global ranges),
multicast, unspecified, reserved, nor any address of this host.
``server.allow_private_media_addresses`` lets loopback, private and this
host's addresses through (a media server next to the model server); even
then a fetch of this server's own port is refused, and link-local,
multicast, unspecified and reserved addresses stay refused.
``server.allowed_media_domains``, when it lists names, narrows fetches to
those host names.

The address checked is the address connected to: ``GuardedResolver`` is
the connector's resolver, so it resolves a name once and hands the
connector only the addresses that passed; aiohttp connects to IP literals
without resolving, so ``url_refusal`` checks those before the request.
Every hop of a redirect chain goes through both (``media.fetch_remote``
follows redirects itself).

``address_refusal`` and ``url_refusal`` are pure; the resolver wraps a real
one (tests inject one that maps names to chosen addresses, so a refusal is
tested without contacting anything).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Any

from aiohttp.abc import AbstractResolver

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class FetchPolicy:
    allowed_domains: frozenset[str] = frozenset()  # empty: any host name
    allow_private: bool = False
    own_addresses: frozenset[Address] = frozenset()  # this host's interface addresses
    own_port: int = 0  # the server's listening port (0: unknown)

    @classmethod
    def from_limits(cls, limits: Any, own: frozenset[Address] | None = None) -> FetchPolicy:
        """From ``MediaLimits``; ``own`` defaults to this host's addresses now."""
        return cls(frozenset(normalize_host(d) for d in limits.allowed_domains), limits.allow_private_addresses,
                   own_addresses() if own is None else own, limits.own_port)


def normalize_host(host: str) -> str:
    return host.lower().rstrip(".")


def own_addresses() -> frozenset[Address]:
    """Every address of this host's interfaces (a public one included)."""
    import psutil

    found = set()
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    found.add(ipaddress.ip_address(entry.address.split("%", 1)[0]))
                except ValueError:
                    continue
    return frozenset(found)


def address_refusal(ip: Address, port: int, policy: FetchPolicy) -> str | None:
    """Why a fetch may not connect to ``ip:port``, or None when it may."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is 127.0.0.1
    is_own = ip in policy.own_addresses or ip.is_loopback or ip.is_unspecified
    if is_own and policy.own_port and port == policy.own_port:
        return "this server itself"
    never = _never_kind(ip)
    if never is not None:
        return never
    private = _private_kind(ip, policy)
    if private is not None and not policy.allow_private:
        return f"{private} (server.allow_private_media_addresses is off)"
    return None


def _never_kind(ip: Address) -> str | None:
    """Addresses no media server has: refused even with private ones allowed."""
    if ip.is_unspecified or (ip.version == 4 and ip in _THIS_NETWORK):  # Linux connects 0.0.0.0 to itself
        return "an unspecified address"
    if ip.is_multicast:
        return "a multicast address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_reserved and not ip.is_loopback:  # IPv6 ::1 lies in the reserved ::/8
        return "a reserved address"
    return None


def _private_kind(ip: Address, policy: FetchPolicy) -> str | None:
    """Addresses inside the operator's network: refused unless opted in."""
    if ip.is_loopback:
        return "a loopback address"
    if ip in policy.own_addresses:
        return "an address of this server"
    if ip.is_private:
        return "a private address"
    if not ip.is_global:
        return "a non-public address"
    return None


_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")


def url_refusal(scheme: str, host: str | None, port: int | None, policy: FetchPolicy) -> str | None:
    """Why a fetch may not request this URL, before any connection: its
    scheme, a host outside ``allowed_domains``, or an IP literal refused
    (names are checked when resolved, by ``GuardedResolver``)."""
    if scheme not in ("http", "https"):
        return f"the scheme {scheme!r} is not fetched (http and https are)"
    if not host:
        return "the URL names no host"
    name = normalize_host(host)
    if policy.allowed_domains and name not in policy.allowed_domains:
        return f"the host {name!r} is not in server.allowed_media_domains"
    literal = _literal_address(name)
    if literal is None:
        return None
    if literal == "malformed":
        return f"the host {name!r} is not a canonical IP address"
    return address_refusal(literal, port or (443 if scheme == "https" else 80), policy)


def _literal_address(host: str) -> Address | str | None:
    """The address an IP-literal host names ("malformed" for a numeric host
    that is not canonical, as aiohttp would connect to it unresolved), or
    None for a name."""
    if ":" not in host and not host.replace(".", "").isdigit():
        return None
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return "malformed"


class AddressRefused(OSError):
    """Every address a name resolved to was refused (aiohttp reports it as a
    connection error of that host)."""


class GuardedResolver(AbstractResolver):
    """The connector's resolver: resolves with ``inner`` and returns only the
    addresses ``policy`` allows, so the connection goes to a checked address
    and the name is never resolved a second time."""

    def __init__(self, policy: FetchPolicy, inner: AbstractResolver):
        self.policy = policy
        self.inner = inner

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET) -> list:
        results = await self.inner.resolve(host, port, family)
        allowed, refused = [], []
        for result in results:
            reason = _result_refusal(result, port, self.policy)
            if reason is None:
                allowed.append(result)
            else:
                refused.append(f"{result['host']} ({reason})")
        if not allowed:
            raise AddressRefused(f"{host} resolves only to refused addresses: {'; '.join(refused) or 'none'}")
        return allowed

    async def close(self) -> None:
        await self.inner.close()


def _result_refusal(result: dict, port: int, policy: FetchPolicy) -> str | None:
    try:
        ip = ipaddress.ip_address(str(result["host"]).split("%", 1)[0])
    except ValueError:
        return "not an IP address"
    return address_refusal(ip, result.get("port") or port, policy)
