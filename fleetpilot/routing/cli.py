"""``fleetpilot router``: the router's command line - its flags, the config and endpoint
source it builds, and the hardened listener it serves the app (``routing.app``) on."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from fleetpilot.argtypes import (
    DefaultsHelpFormatter,
    non_negative_seconds,
    port_number,
    positive_duration,
)
from fleetpilot.files import FileError
from fleetpilot.httpserver import ServerLimits, run_app
from fleetpilot.listening import ListenError
from fleetpilot.logs import add_log_arguments, configure_logging
from fleetpilot.routing.app import build_app
from fleetpilot.routing.auth import check_key_files
from fleetpilot.routing.config import ConfigError, load_config
from fleetpilot.routing.discovery import KubeSliceClient, SliceClient, build_source

# After SIGTERM (and the --shutdown-delay), how long requests in flight may take to finish.
SHUTDOWN_TIMEOUT_S = 30.0

EXIT_INVALID = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="RouterConfig YAML (the ConfigMap file)")
    parser.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    parser.add_argument("--port", type=port_number, help="listen port (default: the config's port)")
    parser.add_argument(
        "--endpoints-file",
        help="YAML/JSON file of endpoints {endpoints: [{tier, role, address}]}, re-read on "
        "change (the local runtime); replaces Kubernetes discovery",
    )
    parser.add_argument(
        "--discovery",
        choices=["auto", "static"],
        default="auto",
        help="auto: Kubernetes EndpointSlices for groups without static addresses; static: "
        "only the config's addresses (and --endpoints-file), never the API server",
    )
    parser.add_argument("--kubeconfig", help="kubeconfig (default: in-cluster credentials)")
    parser.add_argument(
        "--reload-interval",
        type=positive_duration,
        default=1.0,
        help="config/endpoints poll period (1s, 500ms)",
    )
    parser.add_argument("--seed", type=int, help="tie-break random seed (reproducible runs)")
    parser.add_argument(
        "--shutdown-delay",
        type=non_negative_seconds,
        default=0.0,
        help="seconds to keep serving after SIGTERM before the listener closes, while the "
        "router's pod leaves its Service's endpoints (the operator sets it in pods)",
    )
    parser.add_argument(
        "--debug-route-header",
        action="store_true",
        help="show replica addresses in x-fleetpilot-route (the config's debugRouteHeader); "
        "off by default, so clients never see internal pod addresses",
    )
    add_log_arguments(parser)


def _kube_client(kubeconfig: str | None) -> Callable[[], SliceClient]:
    def make() -> SliceClient:
        from fleetpilot.kube.connect import connect

        return KubeSliceClient(connect(kubeconfig))

    return make


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    config_path = Path(args.config)
    try:
        config = load_config(config_path)
        check_key_files(config.auth)
    except (ConfigError, FileError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    endpoints_file = Path(args.endpoints_file) if args.endpoints_file else None
    kube = None if args.discovery == "static" else _kube_client(args.kubeconfig)
    try:
        source = build_source(config, endpoints_file=endpoints_file, kube_client=kube)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    app = build_app(
        config,
        source,
        config_path=config_path,
        reload_interval_s=args.reload_interval,
        seed=args.seed,
        debug_route_header=args.debug_route_header,
        metrics_host=args.host,
    )
    port = args.port or config.port
    try:
        # The shared hardened listener: header timeout, connection limit, one throttled
        # warning per malformed request instead of a traceback each.
        run_app(
            app,
            args.host,
            port,
            # Upstream connections are opened only for requests in flight (bodies arrived),
            # so a client connection still sending its body costs one descriptor, not two:
            # the connection budget is what the open-file limit leaves after maxInFlight of
            # them (taken at start; a reloaded maxInFlight does not change it).
            ServerLimits(upstream_connections=config.backpressure.max_in_flight),
            handler_cancellation=True,
            access_log=None,  # per-request logging would cost more than routing; metrics count
            shutdown_delay_s=args.shutdown_delay,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        )
    except ListenError as exc:  # a port is taken, or the address is not ours: it names which
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fleetpilot router", description=__doc__, formatter_class=DefaultsHelpFormatter
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
