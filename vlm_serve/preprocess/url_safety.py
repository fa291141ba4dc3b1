"""Which network addresses a user-supplied media URL may reach.

A server that fetches URLs on behalf of its callers must not become a proxy into
the network it runs in (SSRF): cloud metadata at 169.254.169.254, services on
localhost, the private LAN. Only globally routable unicast addresses pass.
"""

from __future__ import annotations

import ipaddress
import socket

_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def is_public_ip(address: str) -> bool:
    """True if `address` is a globally routable unicast IP (v4 or v6)."""
    try:
        # Drop an IPv6 zone id ("fe80::1%eth0"), which getaddrinfo may return.
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        # IPv6 forms that carry an IPv4 address reach that IPv4 host: judge the IPv4 one.
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return is_public_ip(str(embedded))
        if ip.is_site_local:  # deprecated fec0::/10, which Python still calls global
            return False
    # is_global excludes private, loopback, link-local, CGNAT (100.64/10), 0.0.0.0/8,
    # documentation and reserved ranges; the explicit checks guard against
    # differences between Python versions, and multicast counts as global there.
    return ip.is_global and not (
        ip.is_multicast
        or ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_reserved
        or ip.is_unspecified
    )


def resolve(host: str, port: int) -> list[str]:
    """All addresses `host` resolves to, in resolver order, without duplicates.

    Raises OSError (socket.gaierror) when the name does not resolve.
    """
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))
