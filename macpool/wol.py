"""Wake-on-LAN: wake a sleeping Mac with a magic packet (the ``wakeonlan`` package builds and sends it)."""

from __future__ import annotations

import re

import wakeonlan

DEFAULT_BROADCAST = "255.255.255.255"
DEFAULT_PORT = 9  # the discard port, where Macs (and most NICs) listen for magic packets

_MAC = re.compile(r"[0-9a-f]{2}([:-]?)[0-9a-f]{2}(?:\1[0-9a-f]{2}){4}")


class BadMac(ValueError):
    """A MAC address that is not six hex bytes."""


def normalize_mac(mac: str) -> str:
    """``AA-BB-CC-DD-EE-FF``, ``aabbccddeeff`` or ``aa:bb:...`` -> ``aa:bb:cc:dd:ee:ff``."""
    text = mac.strip().lower()
    if not _MAC.fullmatch(text):
        raise BadMac(f"MAC address {mac!r}: expected six hex bytes, as aa:bb:cc:dd:ee:ff")
    digits = re.sub(r"[:-]", "", text)
    return ":".join(digits[i:i + 2] for i in range(0, 12, 2))


def wake(mac: str, broadcast: str = DEFAULT_BROADCAST, port: int = DEFAULT_PORT) -> None:
    """Send one magic packet for ``mac`` to ``broadcast``:``port`` (UDP). Blocking: a few microseconds,
    plus a name lookup if ``broadcast`` is a host name."""
    wakeonlan.wake(normalize_mac(mac), host=broadcast, port=port)
