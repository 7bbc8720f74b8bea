"""Every listener's bind failure is one ``error:`` line naming the address and the reason:
router, engine (tests/engine/reference/test_cli_guards.py), operator and autoscaler metrics."""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from fleetpilot.api import parse_service
from fleetpilot.listening import ListenError, listening_on
from fleetpilot.runtime.autoscale import LocalActuator
from fleetpilot.runtime.control import ControlServer
from fleetpilot.runtime.local import LocalFleet
from tests.factories import make_local_manifest
from tests.routing.support import make_config, tier
from tests.support.cli import one_line_error


@contextmanager
def taken_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A port another socket is listening on."""
    with socket.socket() as holder:
        holder.bind((host, 0))
        holder.listen()
        yield int(holder.getsockname()[1])


def test_the_address_and_the_systems_reason_are_named() -> None:
    """The message is the address as typed (IPv6 bracketed) and the errno's words, not
    asyncio's repetition of the address tuple."""
    with taken_port() as port, pytest.raises(ListenError) as info:  # noqa: SIM117
        with listening_on("127.0.0.1", port), socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    assert str(info.value) == f"cannot listen on 127.0.0.1:{port}: Address already in use"
    refused = PermissionError(13, "Permission denied")
    assert str(ListenError("::1", 80, refused)) == "cannot listen on [::1]:80: Permission denied"
    unknown = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert str(ListenError("no-such-host", 80, unknown)) == (
        "cannot listen on no-such-host:80: Name or service not known"
    )


def test_router_on_a_taken_port_is_one_line(tmp_path: Path) -> None:
    """The router's bind failure (one line since the last pass) names the address."""
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(make_config([tier("small", 1.0)]).to_wire()))
    with taken_port() as port:
        line = one_line_error(
            "router", "--config", str(path), "--discovery", "static",
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
            returncode=1,
        )  # fmt: skip
    assert line == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_operator_metrics_port_taken_is_one_line() -> None:
    """Regression: the operator's --metrics-port taken was a 26-line OSError traceback from
    prometheus_client's server."""
    with taken_port() as port:
        line = one_line_error(
            "operator", "--standalone", "--all-namespaces",
            "--bind", "127.0.0.1", "--metrics-port", str(port),
            returncode=1,
        )  # fmt: skip
    assert line == (
        f"error: --metrics-port: cannot listen on 127.0.0.1:{port}: Address already in use"
    )


def test_autoscaler_metrics_port_taken_is_one_line() -> None:
    """The autoscaler's --metrics-port taken (bound once the fleet answers): one line, exit
    1. The fleet is the local runtime's real control API over a fleet with no engines."""
    manifest = make_local_manifest("ctl", replicas={"min": 1, "max": 2}, ttft_p95="1s")
    service = parse_service(manifest)
    with tempfile.TemporaryDirectory() as work:
        actuator = LocalActuator(LocalFleet(service, Path(work), 0))
        control = ControlServer(actuator, service, max_replicas=2)
        control.start()
        try:
            with taken_port() as port:
                line = one_line_error(
                    "autoscaler", "--fleet", control.url, "--fleet-timeout", "60",
                    "--metrics-port", str(port), "--log-level", "warning",
                    returncode=1,
                )  # fmt: skip
        finally:
            control.stop()
            actuator.close()
    assert line == (
        f"error: --metrics-port: cannot listen on 127.0.0.1:{port}: Address already in use"
    )
