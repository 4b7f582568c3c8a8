"""uvicorn's HTTP protocol with a header read timeout (issue 10 #8).

uvicorn bounds idle keep-alive connections but not a client that opens a connection and never
finishes its request headers (its keep-alive timer stops at the first byte of a request).
`header_timeout_protocol(seconds)` returns the protocol class uvicorn would pick (httptools when
installed, else h11) with one addition: if no request has started `seconds` after the connection
opened, or after a response on a kept-alive connection once bytes of the next request came, it
answers 408 in OpenAI's error envelope and closes.
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

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # kept alive: the next request's headers get `seconds` as well
                self._header_timer.cancel()
                self._header_timer = self.loop.call_later(seconds, self._headers_overdue, self.cycle)

        def _headers_overdue(self, last=None) -> None:
            if self.transport.is_closing():
                return
            if last is not None:  # a kept-alive connection's next request, after `last`
                if self.cycle is not last or not last.response_complete:
                    return  # it has begun (pipelined, or its headers came whole)
                if self.timeout_keep_alive_task is not None:  # not a byte of it yet: idle, which uvicorn's keep-alive
                    self._header_timer = self.loop.call_later(seconds, self._headers_overdue, last)  # timer ends
                    return
            elif self.cycle is not None:
                return  # the connection's first request has begun
            logger.info("closing a connection from %s: no request headers within %g s", self.client, seconds)
            self.transport.write(_reply_408(seconds))
            self.transport.close()

        def connection_lost(self, exc) -> None:
            self._header_timer.cancel()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
