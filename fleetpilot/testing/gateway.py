"""A gateway for the tests: the Go program in e2e/gateway, which plays Envoy's side of the
external-processing protocol for an InferencePool in front of an endpoint picker (there is no
Envoy binary here). Built by ``e2e/gateway/build.sh``; started and stopped by ``Gateway``."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Self

from fleetpilot.runtime.processes import StartsAndStops, terminate
from fleetpilot.testing.binaries import go_tool, go_tool_skip_reason
from fleetpilot.testing.errors import ControlPlaneError


def skip_reason() -> str | None:
    """Why the gateway cannot run here (None: it can): it is built with Go."""
    return go_tool_skip_reason("the test gateway")


def gateway_binary(*, build: bool = True) -> Path:
    """The gateway, built first by its build.sh (a no-op when up to date)."""
    return go_tool("gateway", "the test gateway", build=build)


class Gateway(StartsAndStops):
    """The gateway process in front of the picker at ``picker`` (``host:port``; several:
    replicas of one, each request to the next in turn); ``url`` is where clients send their
    requests. With ``subset``, every request carries that subset hint (the endpoints the
    picker may choose among); with ``tls``, it connects to the picker over TLS without
    verifying its certificate, as gateways connect to an InferencePool's. Without a picker,
    ``endpoints`` take the requests in turn (a plain round-robin gateway)."""

    def __init__(
        self,
        picker: str | Sequence[str] = (),
        *,
        endpoints: Sequence[str] = (),
        subset: Sequence[str] | None = None,
        tls: bool = False,
    ) -> None:
        self.pickers = [picker] if isinstance(picker, str) else list(picker)
        self.endpoints = list(endpoints)
        if not self.pickers and not self.endpoints:
            raise ValueError("a gateway needs a picker or endpoints")
        self.subset = subset
        self.tls = tls
        self.url = ""
        self._process: subprocess.Popen[str] | None = None

    def start(self) -> Self:
        argv = [str(gateway_binary()), "--listen", "127.0.0.1:0"]
        if self.pickers:
            argv += ["--picker", ",".join(self.pickers)]
        else:
            argv += ["--endpoints", ",".join(self.endpoints)]
        if self.subset is not None:
            argv += ["--subset", ",".join(self.subset)]
        if self.tls:
            argv.append("--picker-tls")
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        self._process = process
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line:
            self.stop()
            raise ControlPlaneError(f"the gateway exited before listening: {argv}")
        self.url = "http://" + json.loads(line)["listening"]
        return self

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        terminate(process, 10)
        if process.stdout is not None:
            process.stdout.close()
