"""A small control channel: length-prefixed JSON messages over TCP, every wait bounded.

Knows nothing about weights; backends send bucket metadata and acknowledgements through it.
A peer that dies closes its socket, which the other side sees at once as a PeerError.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import struct
import time
from typing import Any

from offbeat.ckpt_engine.errors import PeerError, SyncTimeoutError

_HEADER = struct.Struct("!Q")
_MAX_MESSAGE = 1 << 30


def encode(msg: dict[str, Any]) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


class Conn:
    """One end of a control connection."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self.peer = peer

    def send(self, msg: dict[str, Any] | bytes) -> None:
        """Send a message, or one already encoded by `encode` (sent to several peers, or
        again in a later sync, it is encoded once)."""
        data = msg if isinstance(msg, bytes) else encode(msg)
        try:
            self._sock.settimeout(None)
            self._sock.sendall(_HEADER.pack(len(data)) + data)
        except OSError as e:
            raise PeerError(f"{self.peer}: connection lost while sending ({e})") from e

    def ready(self) -> bool:
        """Whether a message (or EOF) is waiting to be read."""
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
        except (OSError, ValueError):
            return True  # let recv report it
        return bool(readable)

    def recv(self, timeout_s: float) -> dict[str, Any]:
        return json.loads(self.recv_raw(timeout_s))

    def recv_raw(self, timeout_s: float) -> bytes:
        """The next message, still encoded (a receiver that saw the same bytes before may
        reuse what it decoded then)."""
        deadline = time.monotonic() + timeout_s
        (n,) = _HEADER.unpack(self._read(_HEADER.size, deadline, timeout_s))
        if n > _MAX_MESSAGE:
            raise PeerError(f"{self.peer}: message of {n} bytes is not a control message")
        return self._read(n, deadline, timeout_s)

    def _read(self, n: int, deadline: float, timeout_s: float) -> bytes:
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncTimeoutError(f"{self.peer}: no message within {timeout_s:.1f}s")
            try:
                self._sock.settimeout(left)
                chunk = self._sock.recv(n - got)
            except TimeoutError as e:
                raise SyncTimeoutError(f"{self.peer}: no message within {timeout_s:.1f}s") from e
            except OSError as e:
                raise PeerError(f"{self.peer}: connection lost ({e})") from e
            if not chunk:
                raise PeerError(f"{self.peer}: connection closed (process exited or aborted)")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


class Listener:
    """Accepts connections on an ephemeral port of `host`."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._sock = socket.create_server((host, 0), backlog=128)
        self.address = (host, self._sock.getsockname()[1])
        self._closed = False

    def accept(self, deadline: float) -> Conn | None:
        """The next connection, or None if none came before `deadline` (monotonic)."""
        while not self._closed:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                ready, _, _ = select.select([self._sock], [], [], min(left, 0.05))
            except (OSError, ValueError):
                return None
            if ready:
                try:
                    sock, addr = self._sock.accept()
                except OSError:
                    continue
                return Conn(sock, f"receiver at {addr[0]}:{addr[1]}")
        return None

    def close(self) -> None:
        self._closed = True
        self._sock.close()


def connect(address: tuple[str, int] | list, timeout_s: float, peer: str = "sender") -> Conn:
    """Connect to a Listener, retrying until `timeout_s` while it is not up yet."""
    host, port = address
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection(
                (host, port), timeout=max(0.01, deadline - time.monotonic())
            )
            return Conn(sock, f"{peer} at {host}:{port}")
        except OSError as e:
            if time.monotonic() >= deadline:
                raise PeerError(
                    f"could not reach the {peer} at {host}:{port} within {timeout_s:.1f}s ({e})"
                ) from e
            time.sleep(0.02)
