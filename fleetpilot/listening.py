"""A listener that cannot bind, said in one line: every entry point that listens (router,
engine, autoscaler and operator metrics, the operator's standby health, the local control
API) turns the bind's ``OSError`` into :class:`ListenError` and prints ``error: <it>`` instead
of a traceback."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager


def address(host: str, port: int) -> str:
    """``host:port`` as a user would type it (IPv6 bracketed)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _reason(exc: OSError) -> str:
    # asyncio's bind error repeats the address in its text; the system's own words for the
    # errno are the part a user acts on ("Address already in use", "Permission denied").
    if isinstance(exc, socket.gaierror) or not exc.errno:
        return exc.strerror or str(exc)
    return os.strerror(exc.errno)


class ListenError(OSError):
    """Binding ``host:port`` failed; ``str()`` is the one line to show."""

    def __init__(self, host: str, port: int, cause: OSError) -> None:
        super().__init__(cause.errno, _reason(cause))
        self.address = address(host, port)

    def __str__(self) -> str:
        return f"cannot listen on {self.address}: {self.strerror}"


@contextmanager
def listening_on(host: str, port: int) -> Iterator[None]:
    """Around the bind of ``host:port``: an ``OSError`` leaves as :class:`ListenError`."""
    try:
        yield
    except ListenError:
        raise
    except OSError as exc:
        raise ListenError(host, port, exc) from exc
