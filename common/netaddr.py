"""Which local address reaches a given peer; where a server says which port it bound."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def local_address_towards(host: str, port: int) -> str | None:
    """The local address this host's traffic to ``host:port`` leaves from, or None.

    A UDP connect only picks a route; no packet is sent.
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, port))
            return str(probe.getsockname()[0])
    except (OSError, OverflowError):
        return None


def interface_with(address: str) -> str | None:
    """The name of the network interface whose (primary IPv4) address is `address`, or None."""
    import fcntl
    import struct

    get_address = 0x8915  # SIOCGIFADDR
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(probe.fileno(), get_address,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None


def write_port_file(path: str | Path, port: int) -> None:
    """Write the port a server bound (port 0: the kernel chose it) where a launcher waits for
    it; atomically, so the reader never sees a half-written number."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(str(port))
    os.replace(tmp, path)


def is_loopback(host: str) -> bool:
    """Does `host` (a name or an address) resolve only to loopback addresses?"""
    import ipaddress

    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback
                               for info in infos)
