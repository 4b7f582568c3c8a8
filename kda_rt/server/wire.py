"""Frames between the HTTP process and the engine process: a 4-byte big-endian length, then one
msgpack map.  Both ends speak over one Unix stream socket (a `socketpair`).

Every message is a map with an `"op"` key.  HTTP -> engine: `add`, `abort`, `stats`, `tokenize`,
`detokenize`, `shutdown`.  Engine -> HTTP: `ready` / `failed` (once, after loading), `added` /
`rejected` (answer to `add`, `tokenize`, `detokenize`), `result` (answer to `tokenize` /
`detokenize`), `outs` (per-request deltas of one engine step), `stats`, `beat`, `fatal` (the
engine is about to exit).
"""

from __future__ import annotations

import asyncio
import select
import socket
import struct
from typing import Any

import msgpack

__all__ = ["MAX_FRAME_BYTES", "FrameError", "pack", "FrameSocket", "read_frame"]

MAX_FRAME_BYTES = 256 * 1024 * 1024  # a frame larger than this is a protocol error, not data
_LEN = struct.Struct(">I")


class FrameError(RuntimeError):
    """The peer sent something that is not a frame of this protocol."""


def pack(message: dict[str, Any]) -> bytes:
    """One frame: length prefix + msgpack body."""
    body = msgpack.packb(message, use_bin_type=True)
    return _LEN.pack(len(body)) + body


def _unpack(body: bytes) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise FrameError(f"undecodable frame ({type(exc).__name__}: {exc})") from None
    if not isinstance(message, dict) or "op" not in message:
        raise FrameError(f"frame is not a message map: {message!r:.80}")
    return message


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """Next message from an asyncio stream; None at a clean end of stream."""
    try:
        head = await reader.readexactly(_LEN.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise FrameError("stream ended inside a frame header") from None
        return None
    (size,) = _LEN.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        body = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise FrameError("stream ended inside a frame") from None
    return _unpack(body)


class FrameSocket:
    """Blocking side (the engine process): send frames, and poll for whole frames with a timeout."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self.sock = sock
        self._buf = bytearray()
        self.closed = False  # the peer closed its end

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(pack(message))

    def poll(self, timeout: float | None) -> list[dict[str, Any]]:
        """Every whole message that arrives within `timeout` seconds (None: wait for at least one).
        Sets `closed` and returns what it has when the peer hangs up."""
        messages: list[dict[str, Any]] = []
        wait = timeout
        while not self.closed:
            ready, _, _ = select.select([self.sock], [], [], wait)
            if not ready:
                break
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                self.closed = True
                break
            self._buf += chunk
            messages += self._split()
            if messages:
                wait = 0.0  # take what is already buffered in the kernel, then return
        return messages

    def _split(self) -> list[dict[str, Any]]:
        out = []
        while len(self._buf) >= _LEN.size:
            (size,) = _LEN.unpack_from(self._buf)
            if size > MAX_FRAME_BYTES:
                raise FrameError(f"frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
            if len(self._buf) < _LEN.size + size:
                break
            out.append(_unpack(bytes(self._buf[_LEN.size:_LEN.size + size])))
            del self._buf[:_LEN.size + size]
        return out
