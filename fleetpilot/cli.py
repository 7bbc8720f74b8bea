"""The ``fleetpilot`` command: one CLI, one subcommand per part."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from fleetpilot import __version__
from fleetpilot.api import InvalidManifestError, load_services
from fleetpilot.api.crd import CRD_FILENAME, render_crd
from fleetpilot.operator.plan_types import PlanError, PlanOptions
from fleetpilot.operator.planner import plan
from fleetpilot.operator.summary import summarize

EXIT_INVALID = 2
EXIT_STALE = 1


def _crds(args: argparse.Namespace) -> int:
    target = Path(args.out) / CRD_FILENAME
    expected = render_crd()
    if args.check:
        current = target.read_text(encoding="utf-8") if target.exists() else None
        if current != expected:
            print(
                f"{target} is stale: run `fleetpilot crds` and commit the result",
                file=sys.stderr,
            )
            return EXIT_STALE
        print(f"{target} is up to date")
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(expected, encoding="utf-8")
    print(f"wrote {target}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    try:
        services = load_services(Path(args.file))
    except InvalidManifestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    options = PlanOptions(pod_monitor_available=args.pod_monitor)
    outputs = []
    for service in services:
        try:
            objects = plan(service, options)
        except PlanError as exc:
            print(f"error: {args.file}: {service.name}: {exc}", file=sys.stderr)
            return EXIT_INVALID
        outputs.append((service, objects))
    if args.output == "summary":
        print("\n\n".join(summarize(service, objects) for service, objects in outputs))
    elif args.output == "json":
        items = [obj for _, objects in outputs for obj in objects]
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}, indent=2))
    else:
        items = [obj for _, objects in outputs for obj in objects]
        print(yaml.safe_dump_all(items, sort_keys=False), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetpilot", description="Kubernetes operator for LLM inference fleets."
    )
    parser.add_argument("--version", action="version", version=f"fleetpilot {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    crds = sub.add_parser("crds", help="write the CRD generated from the API models")
    crds.add_argument("--out", default="crds", help="directory to write into (default: crds)")
    crds.add_argument(
        "--check", action="store_true", help="exit non-zero when the file on disk is stale"
    )
    crds.set_defaults(func=_crds)

    plan_cmd = sub.add_parser("plan", help="print the objects an InferenceService becomes")
    plan_cmd.add_argument("-f", "--file", required=True, help="InferenceService YAML file")
    plan_cmd.add_argument(
        "-o", "--output", choices=["yaml", "json", "summary"], default="yaml", help="format"
    )
    plan_cmd.add_argument(
        "--pod-monitor",
        action="store_true",
        help="plan for a cluster that has the Prometheus Operator's PodMonitor CRD",
    )
    plan_cmd.set_defaults(func=_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
