"""The ``fleetpilot`` command: one CLI, one subcommand per part."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import select
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import yaml

from fleetpilot import __version__
from fleetpilot.api import InvalidManifestError, load_services
from fleetpilot.api.crd import CRD_FILENAME, crd, render_crd
from fleetpilot.api.units import parse_quantity, quantity_decimal
from fleetpilot.argtypes import DefaultsHelpFormatter, port_number, positive_duration
from fleetpilot.listening import ListenError, listening_on
from fleetpilot.operator.plan_types import (
    DEFAULT_FLEETPILOT_IMAGE,
    DEFAULT_REFERENCE_IMAGE,
    PlanError,
    PlanOptions,
)
from fleetpilot.operator.planner import capacity_warnings, plan
from fleetpilot.operator.summary import summarize

EXIT_INVALID = 2
EXIT_STALE = 1
# A leader that could not renew its Lease: the process stops so that only one replica acts.
EXIT_LOST_LEADERSHIP = 3
EXIT_BIND = 1  # a port that cannot be listened on, as `router` and `engine` exit
# stdout's reader left before the output ended (`fleetpilot plan -o json | head -1`): what a
# shell reports for kubectl, which SIGPIPE ends, in the same pipe (128 + SIGPIPE), and quietly.
EXIT_BROKEN_PIPE = 141


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line: what is wrong and where to read more.

    argparse prints the whole usage block before the error; in a terminal or a CI log the one
    line that matters then hides below a screenful of flags.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_INVALID, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _crds(args: argparse.Namespace) -> int:
    if args.output is not None:
        if args.check:
            print("error: --check compares the file in --out; it takes no -o", file=sys.stderr)
            return EXIT_INVALID
        if args.output == "json":
            print(json.dumps(crd(), indent=2))
        else:
            print(render_crd(), end="")
        return 0
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


def memory_bytes(text: str) -> int:
    """A memory quantity (``512Gi``, ``2T``, ``1073741824``) as whole bytes, above zero."""
    try:
        value = quantity_decimal(parse_quantity(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a quantity: use e.g. 512Gi") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not more than 0 bytes")
    return int(value.to_integral_value(rounding="ROUND_CEILING"))


def _plan(args: argparse.Namespace) -> int:
    try:
        services = load_services(Path(args.file), recursive=args.recursive)
    except InvalidManifestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    options = PlanOptions(
        pod_monitor_available=args.pod_monitor,
        leader_worker_set_available=not args.no_leader_worker_set,
        node_memory=args.node_memory,
    )
    outputs = []
    for service in services:
        try:
            objects = plan(service, options)
        except PlanError as exc:
            print(f"error: {args.file}: {service.name}: {exc}", file=sys.stderr)
            return EXIT_INVALID
        outputs.append((service, objects))
    if args.output == "summary":  # the summary lists them itself
        url = args.prometheus_url
        print("\n\n".join(summarize(service, objects, url) for service, objects in outputs))
        return 0
    for service, _ in outputs:
        for warning in capacity_warnings(service):
            print(f"warning: {args.file}: {service.name}: {warning}", file=sys.stderr)
    if args.output == "json":
        items = [obj for _, objects in outputs for obj in objects]
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}, indent=2))
    else:
        items = [obj for _, objects in outputs for obj in objects]
        print(review_yaml(items), end="")
    return 0


class _ReviewDumper(yaml.SafeDumper):
    """YAML a reviewer can diff, as kubectl writes it: every object spelt out where it is used
    (PyYAML writes a dict two objects share once, as ``&id001``, and then ``*id001``), and a
    string of several lines - a ConfigMap's embedded file - as a literal block (``|``) rather
    than one quoted line of ``\\n``s."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    # PyYAML falls back to a quoted string where a block cannot hold the text exactly (a
    # line ending in a space, a control character).
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_ReviewDumper.add_representer(str, _represent_str)

# No line folding: a long string stays one line, so a change to it is a change to one line.
_NO_FOLDING = 1 << 30


def review_yaml(objects: Sequence[Any]) -> str:
    """``objects`` as a YAML stream (``---`` between documents) a reviewer can diff: keys in
    their order, no anchors or aliases, multi-line strings as literal blocks, long lines kept
    whole."""
    return yaml.dump_all(
        objects, Dumper=_ReviewDumper, sort_keys=False, width=_NO_FOLDING, allow_unicode=True
    )


def _operator(args: argparse.Namespace) -> int:
    import time

    # Flags checked before anything is imported, configured or listened on.
    if args.leader_election and (args.lease_duration < 3 or not args.lease_duration.is_integer()):
        print(
            "error: --lease-duration must be whole seconds, at least 3s (a Lease counts "
            f"seconds); got {args.lease_duration:g}s",
            file=sys.stderr,
        )
        return EXIT_INVALID
    if args.kubeconfig:
        # Before the kubernetes client is imported: it reads KUBECONFIG once, at import.
        os.environ["KUBECONFIG"] = args.kubeconfig
    # Imported here: kopf and the kubernetes client are heavy and only this command needs them.
    import kopf
    from prometheus_client import start_http_server

    from fleetpilot.operator.handlers import build_registry, quiet_watch_handlers

    if not args.namespace and not args.all_namespaces:
        print("error: give --namespace NS (repeatable) or --all-namespaces", file=sys.stderr)
        return EXIT_INVALID
    from fleetpilot.logs import configure_operator_logging

    # The router's and the engines' log layout (fleetpilot.logs), not kopf's own.
    configure_operator_logging(args.log_format, verbose=args.verbose)
    if not args.verbose:
        quiet_watch_handlers()
    if args.metrics_port:
        try:
            with listening_on(args.bind, args.metrics_port):
                start_http_server(args.metrics_port, addr=args.bind)
        except ListenError as exc:
            print(f"error: --metrics-port: {exc}", file=sys.stderr)
            return EXIT_BIND
    priority = 0
    if args.leader_election:
        lease_namespace = (
            args.leader_election_namespace
            or os.environ.get("POD_NAMESPACE")
            or (args.namespace[0] if args.namespace else None)
        )
        if not lease_namespace:
            print("error: --leader-election needs --leader-election-namespace", file=sys.stderr)
            return EXIT_INVALID
        try:
            _wait_for_leadership(args, lease_namespace)
        except ListenError as exc:  # the standby's /healthz
            print(f"error: --liveness-port: {exc}", file=sys.stderr)
            return EXIT_BIND
        # A newer leader outranks an older one in kopf's peering: a killed leader's peering
        # record never pauses its successor, and an operator outside the election yields.
        priority = int(time.time())
    registry = build_registry(
        fleetpilot_image=args.image,
        reference_image=args.reference_image,
        kubeconfig=args.kubeconfig,
        prometheus_url=args.prometheus_url,
    )
    liveness = f"http://{args.bind}:{args.liveness_port}/healthz" if args.liveness_port else None
    kopf.run(
        registry=registry,
        # A named peering is mandatory in kopf: without its CRD the operator waits rather
        # than risk two replicas acting at once. --standalone opts out for one replica.
        standalone=True if args.standalone else None,
        peering_name=None if args.standalone else args.peering,
        namespaces=args.namespace or (),
        clusterwide=args.all_namespaces,
        liveness_endpoint=liveness,
        priority=priority,
    )
    return 0


def _wait_for_leadership(args: argparse.Namespace, lease_namespace: str) -> None:
    """Block as a standby (serving /healthz) until this process holds the Lease."""
    import logging

    from fleetpilot.kube.connect import connect
    from fleetpilot.operator.leadership import (
        Leadership,
        LeaseSettings,
        StandbyHealth,
        default_identity,
    )

    log = logging.getLogger("fleetpilot.operator")

    def lost() -> None:
        log.error("lost the lease: exiting so that no two replicas act at once")
        os._exit(EXIT_LOST_LEADERSHIP)

    settings = LeaseSettings(
        name=args.leader_election_name,
        namespace=lease_namespace,
        identity=args.identity or default_identity(),
        lease_duration_s=int(args.lease_duration),
        renew_deadline_s=max(1, int(args.lease_duration) * 2 // 3),
        retry_period_s=max(1, int(args.lease_duration) // 7),
    )
    leadership = Leadership(connect(args.kubeconfig), settings, lost)
    standby = None
    if args.liveness_port:
        with listening_on(args.bind, args.liveness_port):
            standby = StandbyHealth(args.bind, args.liveness_port)
    leadership.start()
    leadership.wait()
    if standby is not None:
        standby.close()


ENGINE_BACKENDS = {
    "vllm": "fleetpilot.engine.launcher",
    "reference": "fleetpilot.engine.reference.server",
}


ENGINE_BACKEND_SUMMARIES = {
    "reference": "the CPU reference engine: vLLM's OpenAI API, and vLLM's flags where it has one",
    "vllm": "exec `vllm serve` with the engine settings the planner computed (GPU)",
}


class _EngineHelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultsHelpFormatter):
    """The engine's help: the other backend's flags come as a formatted epilog, kept as is."""


def _other_backends_help(chosen: str) -> str:
    """The flags of every backend but ``chosen``, each under a heading, for the end of
    ``fleetpilot engine --help``: the reference engine's flags are not vLLM's, and a user
    reading one backend's help should learn the other's exists and what it takes."""
    sections = []
    for name in sorted(ENGINE_BACKENDS):
        if name == chosen:
            continue
        heading = f"--backend {name} options"
        try:
            backend = importlib.import_module(ENGINE_BACKENDS[name])
        except ImportError as exc:  # the vLLM image without the reference engine's packages
            sections.append(f"{heading}: not shown, its packages are not installed ({exc})")
            continue
        other = _Parser(
            prog=f"fleetpilot engine --backend {name}",
            usage=argparse.SUPPRESS,
            add_help=False,
            formatter_class=DefaultsHelpFormatter,
        )
        backend.add_arguments(other)
        flags = other.format_help().strip("\n")
        # argparse titles the section "options:" (3.10+) or "optional arguments:".
        sections.append(flags.replace("options:", f"{heading}:", 1))
    return "\n\n".join(sections)


def _engine_description(chosen: str, other_flags: bool) -> str:
    backends = "\n".join(
        f"  {name:<10} {summary}" for name, summary in ENGINE_BACKEND_SUMMARIES.items()
    )
    text = f"Run an inference engine. --backend picks one:\n{backends}"
    if other_flags:
        text += f"\n\nThe options are --backend {chosen}'s; the other backend's follow them."
    return text


def _engine(argv: Sequence[str]) -> int:
    """``fleetpilot engine --backend B ...``: each backend parses its own flags; ``--help``
    lists the chosen backend's flags, then the other's."""
    chooser = _Parser(prog="fleetpilot engine", add_help=False)
    chooser.add_argument("--backend", choices=sorted(ENGINE_BACKENDS), default="vllm")
    known, rest = chooser.parse_known_args(argv)
    wants_help = "-h" in rest or "--help" in rest
    parser = _Parser(
        prog=f"fleetpilot engine --backend {known.backend}",
        description=_engine_description(known.backend, wants_help),
        # Imported for --help only: the reference backend pulls in torch, the vLLM one must not.
        epilog=_other_backends_help(known.backend) if wants_help else None,
        formatter_class=_EngineHelpFormatter,
    )
    # Shown in --help (and accepted again) so `fleetpilot engine --help` names both backends.
    parser.add_argument(
        "--backend",
        choices=sorted(ENGINE_BACKENDS),
        default=known.backend,
        help="vllm: exec `vllm serve` (GPU); reference: the CPU reference engine",
    )
    # Imported on demand: the reference backend pulls in torch, the vLLM one must not.
    backend = importlib.import_module(ENGINE_BACKENDS[known.backend])
    backend.add_arguments(parser)
    return int(backend.run(parser.parse_args(rest)))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fleetpilot", description="Kubernetes operator for LLM inference fleets.")
    parser.add_argument("--version", action="version", version=f"fleetpilot {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    crds = sub.add_parser(
        "crds",
        help="write the CRD generated from the API models into crds/ (-o: print it instead)",
    )
    crds.add_argument("--out", default="crds", help="directory to write into (default: crds)")
    crds.add_argument(
        "-o",
        "--output",
        choices=["yaml", "json"],
        help="print the CRD to stdout in this format instead of writing --out (e.g. "
        "`fleetpilot crds -o yaml | kubectl apply --server-side -f -`)",
    )
    crds.add_argument(
        "--check", action="store_true", help="exit non-zero when the file on disk is stale"
    )
    crds.set_defaults(func=_crds)

    plan_cmd = sub.add_parser("plan", help="print the objects an InferenceService becomes")
    plan_cmd.add_argument(
        "-f",
        "--file",
        required=True,
        help="manifest file (- for standard input), or a folder of *.yaml, *.yml and *.json "
        "files; other kinds than InferenceService are skipped with a note on stderr",
    )
    plan_cmd.add_argument(
        "-R",
        "--recursive",
        action="store_true",
        help="with -f FOLDER, read the folders below it too",
    )
    plan_cmd.add_argument(
        "-o", "--output", choices=["yaml", "json", "summary"], default="yaml", help="format"
    )
    plan_cmd.add_argument(
        "--pod-monitor",
        action="store_true",
        help="plan for a cluster that has the Prometheus Operator's PodMonitor CRD",
    )
    plan_cmd.add_argument(
        "--no-leader-worker-set",
        action="store_true",
        help="plan for a cluster without LeaderWorkerSet (replicas larger than a node refused)",
    )
    plan_cmd.add_argument(
        "--node-memory",
        type=memory_bytes,
        metavar="QUANTITY",
        help="the largest allocatable memory of a node that can run an engine pod (e.g. "
        "1800Gi): a pod asking for more (resources.memory and engine.kvOffload.size with its "
        "margin) is refused; unset: not checked",
    )
    plan_cmd.add_argument(
        "--prometheus-url",
        help="the operator's Prometheus (the chart's prometheusURL): without it, or a "
        "service's spec.monitoring.prometheusUrl, -o summary says autoscaled tiers are not",
    )
    plan_cmd.set_defaults(func=_plan)

    op = sub.add_parser("operator", help="run the operator (kopf) against a cluster")
    scope = op.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace", action="append", default=[], help="namespace to serve (repeatable)"
    )
    scope.add_argument("--all-namespaces", action="store_true", help="serve every namespace")
    op.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then KUBECONFIG)")
    op.add_argument(
        "--standalone", action="store_true", help="no leader election (one replica only)"
    )
    op.add_argument(
        "--peering",
        default="fleetpilot",
        help="kopf peering object: operators sharing it never act at once (default: fleetpilot)",
    )
    op.add_argument(
        "--leader-election",
        action="store_true",
        help="run as one of several replicas: act only while holding a Lease, stand by before",
    )
    op.add_argument(
        "--leader-election-namespace",
        help="namespace of the Lease (default: $POD_NAMESPACE, else the first --namespace)",
    )
    op.add_argument(
        "--leader-election-name", default="fleetpilot", help="the Lease (default: fleetpilot)"
    )
    op.add_argument(
        "--lease-duration",
        type=positive_duration,
        default=15.0,
        metavar="DURATION",
        help="how long a standby waits on an unrenewed Lease before taking over: whole "
        "seconds, 3s or more, e.g. 15s, 1m (a plain number is seconds; default: 15s)",
    )
    op.add_argument(
        "--identity", help="this replica's name in the Lease (default: $POD_NAME or host, unique)"
    )
    op.add_argument("--image", default=DEFAULT_FLEETPILOT_IMAGE, help="router image to deploy")
    op.add_argument(
        "--reference-image",
        default=DEFAULT_REFERENCE_IMAGE,
        help="CPU reference engine image, for tiers with engine.backend reference "
        f"(default: {DEFAULT_REFERENCE_IMAGE})",
    )
    op.add_argument(
        "--prometheus-url",
        help="Prometheus the autoscaler reads (a service's spec.monitoring.prometheusUrl wins); "
        "without either, services are not autoscaled",
    )
    op.add_argument("--bind", default="0.0.0.0", help="address of the health/metrics servers")
    op.add_argument(
        "--liveness-port", type=port_number, default=8080, help="/healthz port (0: off)"
    )
    op.add_argument("--metrics-port", type=port_number, default=9090, help="/metrics port (0: off)")
    op.add_argument(
        "--log-format", choices=["plain", "json"], default="json", help="log line format"
    )
    op.add_argument("--verbose", action="store_true", help="debug logging (every handler step)")
    op.set_defaults(func=_operator)

    # Listed for --help; `main` hands these to their own parsers.
    sub.add_parser(
        "engine",
        help="run an engine: --backend vllm (exec vllm serve) or --backend reference (CPU)",
        add_help=False,
    )
    sub.add_parser(
        "router",
        help="run the router: complexity tiers, prefix affinity, load, P/D, retries",
        add_help=False,
    )
    sub.add_parser(
        "up", help="run a service locally: reference engines and the router", add_help=False
    )
    sub.add_parser(
        "autoscaler",
        help="scale a local fleet (fleetpilot up's control API) on Prometheus or /metrics",
        add_help=False,
    )
    sub.add_parser(
        "bench",
        help="load an OpenAI-compatible URL (Poisson, schedule or concurrency)",
        add_help=False,
    )
    sub.add_parser(
        "simulate",
        help="simulate a service's fleet under a load with the real router and autoscaler "
        "policies ('simulate calibrate' measures the reference engine)",
        add_help=False,
    )
    sub.add_parser(
        "model",
        help="'model fetch hub|s3': fill a model cache folder once, verified (a download Job)",
        add_help=False,
    )
    return parser


@dataclass(frozen=True)
class _DelegatedCommand:
    """A command whose module parses its own flags (``add_arguments``) and runs them
    (``run``): imported only when run, since the modules are heavy (aiohttp, torch)."""

    name: str
    module: str
    description: str

    def __call__(self, argv: Sequence[str]) -> int:
        module = importlib.import_module(self.module)
        parser = _Parser(prog=f"fleetpilot {self.name}", description=self.description)
        module.add_arguments(parser)
        return int(module.run(parser.parse_args(argv)))


_DELEGATED = [
    _DelegatedCommand(
        "router",
        "fleetpilot.routing.cli",
        "Route OpenAI requests to tiers by complexity and to replicas by prefix.",
    ),
    _DelegatedCommand("up", "fleetpilot.runtime.up", "Run an InferenceService on this machine."),
    _DelegatedCommand(
        "autoscaler", "fleetpilot.autoscaler.cli", "Scale a local fleet on its SLOs."
    ),
    _DelegatedCommand(
        "bench", "fleetpilot.loadgen.cli", "Load an OpenAI-compatible endpoint and report."
    ),
    _DelegatedCommand(
        "model", "fleetpilot.delivery.cli", "Fetch a model into a cache folder, verified."
    ),
]


def _simulate(argv: Sequence[str]) -> int:
    if argv[:1] == ["calibrate"]:
        return _DelegatedCommand(
            "simulate calibrate",
            "fleetpilot.simulate.calibrate",
            "Measure the reference engine's step costs into a simulator profile.",
        )(argv[1:])
    return _DelegatedCommand(
        "simulate",
        "fleetpilot.simulate.cli",
        "Simulate a service's fleet with its real router and autoscaler policies.",
    )(argv)


# Commands whose modules are heavy (aiohttp, torch): imported only when run.
LAZY_COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {
    "engine": _engine,
    "simulate": _simulate,
    **{command.name: command for command in _DELEGATED},
}


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe (or socket) whose reader has closed it: what a
    BrokenPipeError then means. Another broken pipe (a socket a command writes to) is a fault
    and is raised on."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        events = poll.poll(0)
    except (AttributeError, OSError, ValueError):  # no poll (Windows), no descriptor
        return False
    return any(mask & (select.POLLERR | select.POLLHUP) for _, mask in events)


def _quiet_stdout() -> None:
    """Point stdout's descriptor at /dev/null: what is left in its buffer is flushed there at
    exit, instead of the interpreter printing "Exception ignored ... BrokenPipeError"."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _run(argv: list[str]) -> int:
    if argv[:1] and argv[0] in LAZY_COMMANDS:
        return LAZY_COMMANDS[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _run(argv)
        sys.stdout.flush()  # what is still buffered meets a closed pipe here, in the guard
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise
        # `fleetpilot plan -o json | head -1`: the reader has what it wanted. Quiet, as
        # kubectl and every Unix filter end there, not a traceback.
        _quiet_stdout()
        return EXIT_BROKEN_PIPE
    return code


if __name__ == "__main__":
    raise SystemExit(main())
