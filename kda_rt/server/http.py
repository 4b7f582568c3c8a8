"""uvicorn's HTTP protocol with a header read timeout (issue 10 #8).

uvicorn bounds idle keep-alive connections but not a client that opens a connection and never
finishes its request headers.  `header_timeout_protocol(seconds)` returns the protocol class uvicorn
would pick (httptools when installed, else h11) with one addition: if no request has started
`seconds` after the connection opened, it answers 408 in OpenAI's error envelope and closes.
"""

from __future__ import annotations

import asyncio
import json
import logging

__all__ = ["header_timeout_protocol"]

logger = logging.getLogger("kda_rt.server")


def _base():
    try:
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return base


def _reply_408(seconds: float) -> bytes:
    body = json.dumps({"error": {"message": f"request headers not received within {seconds:g} s (--header-timeout)",
                                 "type": "BadRequestError", "param": None, "code": 408}}).encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def header_timeout_protocol(seconds: float) -> type[asyncio.Protocol]:
    base = _base()

    class HeaderTimeoutProtocol(base):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_timer = self.loop.call_later(seconds, self._headers_overdue)

        def _headers_overdue(self) -> None:
            if self.cycle is None and not self.transport.is_closing():  # no request has started
                logger.info("closing a connection from %s: no request headers within %g s", self.client, seconds)
                self.transport.write(_reply_408(seconds))
                self.transport.close()

        def connection_lost(self, exc) -> None:
            self._header_timer.cancel()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
