"""The command line of the test control plane: `up` starts a detached cluster with fake GPU
nodes and prints its kubeconfig path, `down` stops it, `status` prints the kubeconfig of the
one running. This is what `make cluster-up` and `make cluster-down` run::

    python -m fleetpilot.testing.cli up --dir .cache/cluster    # prints the kubeconfig
    python -m fleetpilot.testing.cli down --dir .cache/cluster

Only the kubeconfig path goes to stdout (scripts read it); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from fleetpilot.argtypes import positive_duration
from fleetpilot.testing.controlplane import ControlPlane

DEFAULT_NODES = ("gpu-h100-0=NVIDIA-H100-80GB-HBM3:8", "gpu-a100-0=NVIDIA-A100-SXM4-80GB:8")


def _parse_node(spec: str) -> tuple[str, str, int]:
    name, _, rest = spec.partition("=")
    product, _, gpus = rest.partition(":")
    if not name or not product:
        raise argparse.ArgumentTypeError(f"expected NAME=PRODUCT[:GPUS], got {spec!r}")
    return name, product, int(gpus or "8")


def main(argv: Sequence[str] | None = None) -> int:
    """`up` starts a detached control plane and prints its kubeconfig path; `down` stops it."""
    parser = argparse.ArgumentParser(
        prog="python -m fleetpilot.testing.cli",
        description="A real Kubernetes control plane on loopback, for operator and e2e tests.",
    )
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--dir", type=Path, default=Path(".cache/cluster"), help="work folder")
    parser.add_argument("--bin-dir", type=Path, default=None, help="folder with the binaries")
    parser.add_argument("--no-build", action="store_true", help="do not run build.sh first")
    parser.add_argument(
        "--gpu-node",
        action="append",
        type=_parse_node,
        metavar="NAME=PRODUCT[:GPUS]",
        help=f"fake GPU node to register (repeatable; default: {', '.join(DEFAULT_NODES)})",
    )
    parser.add_argument("--no-gpu-nodes", action="store_true", help="register no fake nodes")
    parser.add_argument("--timeout", type=positive_duration, default=180.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    # `up` and `down` are separate processes: the cluster `up` left is found through its
    # state.json and adopted.
    running = ControlPlane.adopt(args.dir)
    if args.command == "status":
        if running is None:
            print("not running", file=sys.stderr)
            return 1
        print(running.kubeconfig)
        return 0
    if args.command == "down":
        if running is None:
            print(f"no control plane running in {args.dir}", file=sys.stderr)
            return 0
        running.stop()
        return 0
    if running is not None:
        if running.running():
            print(f"already running: {running.server}", file=sys.stderr)
            print(running.kubeconfig)
            return 0
        print("stopping the remains of a broken control plane", file=sys.stderr)
        running.stop()
    nodes: list[tuple[str, str, int]] = []
    if not args.no_gpu_nodes:
        nodes = args.gpu_node or [_parse_node(spec) for spec in DEFAULT_NODES]
    plane = ControlPlane(
        args.dir, bin_dir=args.bin_dir, build=not args.no_build, die_with_parent=False
    )
    try:
        plane.start(timeout=args.timeout)
        for name, product, gpus in nodes:
            plane.add_gpu_node(name, product, gpus)
    except BaseException:
        plane.stop()
        raise
    print(plane.kubeconfig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
