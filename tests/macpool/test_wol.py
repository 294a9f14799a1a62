"""Wake-on-LAN sends a well-formed magic packet for the right MAC, here to a UDP listener on loopback."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from macpool.wol import BadMac, normalize_mac, wake


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(5)
    yield sock
    sock.close()


def test_the_listener_receives_a_magic_packet_for_the_mac(listener: socket.socket) -> None:
    wake("A0-CE-C8-01-02-0F", broadcast="127.0.0.1", port=listener.getsockname()[1])
    packet, _ = listener.recvfrom(1024)
    assert packet == b"\xff" * 6 + bytes.fromhex("a0cec801020f") * 16


@pytest.mark.parametrize(
    ("given", "expected"),
    [("AA:BB:CC:DD:EE:FF", "aa:bb:cc:dd:ee:ff"), ("aabbccddeeff", "aa:bb:cc:dd:ee:ff"),
     ("aa-bb-cc-dd-ee-ff", "aa:bb:cc:dd:ee:ff")],
)
def test_mac_spellings_are_normalized(given: str, expected: str) -> None:
    assert normalize_mac(given) == expected


@pytest.mark.parametrize(
    "bad", ["", "aa:bb:cc:dd:ee", "aa:bb:cc:dd:ee:gg", "aa:bb-cc:dd:ee:ff", "aabb.ccdd.eeff"]
)
def test_a_bad_mac_is_refused_before_anything_is_sent(bad: str, listener: socket.socket) -> None:
    with pytest.raises(BadMac, match="MAC address"):
        wake(bad, broadcast="127.0.0.1", port=listener.getsockname()[1])
