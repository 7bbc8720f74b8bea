"""The fleetpilot command: what a user types and what they see."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fleetpilot.cli import main
from tests.factories import make_manifest, make_tier
from tests.support.cli import one_line_error

REPO = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, manifest: object) -> str:
    path = tmp_path / "service.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return str(path)


def test_plan_prints_yaml_objects(capsys: pytest.CaptureFixture[str]) -> None:
    """`fleetpilot plan` prints the planned objects as a YAML stream `kubectl apply -f -` can
    read."""
    assert main(["plan", "-f", str(REPO / "examples" / "two-tier.yaml")]) == 0
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    assert ("Deployment", "chat-large") in [(o["kind"], o["metadata"]["name"]) for o in objects]


def test_plan_prints_json_list(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """`-o json` prints one v1 List, the shape kubectl and jq expect."""
    assert main(["plan", "-f", _write(tmp_path, make_manifest()), "-o", "json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["kind"] == "List"
    assert listing["items"]


def test_plan_summary_shows_roles_gpus_and_command(capsys: pytest.CaptureFixture[str]) -> None:
    """`-o summary` shows per role the GPUs per replica and the exact `vllm serve` line, what the
    README and `make demo` promise."""
    assert main(["plan", "-f", str(REPO / "examples" / "disaggregated.yaml"), "-o", "summary"]) == 0
    out = capsys.readouterr().out
    assert "tier main / prefill" in out
    assert "GPUs per replica: 8 x NVIDIA-H100-80GB-HBM3" in out
    assert "command: vllm serve /models/llama-3.1-70b-instruct" in out


def test_plan_summary_shows_the_engine_backend(capsys: pytest.CaptureFixture[str]) -> None:
    """`-o summary` says which engine each tier runs: for the CPU example the reference
    engine, its preset, its CPU and memory, its image and command, no weights and no GPU; for
    a GPU example vLLM."""
    assert main(["plan", "-f", str(REPO / "examples" / "cpu-two-tier.yaml"), "-o", "summary"]) == 0
    out = capsys.readouterr().out
    assert "engine: reference (CPU, no GPU; tiny preset, context 2048 tokens), cpu 1" in out
    assert "engine: reference (CPU, no GPU; small preset, context 4096 tokens)" in out
    assert "weights: none: a seeded random model (small preset)" in out
    assert "image: ghcr.io/fleetpilot/fleetpilot-reference:" in out
    assert "command: fleetpilot engine --backend reference --host 0.0.0.0 --port 8000" in out
    assert "GPUs: 0 at start, up to 0 at max scale" in out
    assert "GPUs per replica" not in out
    assert main(["plan", "-f", str(REPO / "examples" / "two-tier.yaml"), "-o", "summary"]) == 0
    assert "    engine: vllm\n    GPUs per replica: 1" in capsys.readouterr().out


def test_plan_summary_shows_nodes_per_replica_and_both_command_lines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A replica over 2 nodes: the summary says how it is cut and prints the leader's and the
    workers' lines; `--no-leader-worker-set` plans for a cluster without LWS and refuses it."""
    example = str(REPO / "examples" / "llama-405b-multinode.yaml")
    assert main(["plan", "-f", example, "-o", "summary"]) == 0
    out = capsys.readouterr().out
    assert "nodes per replica: 2 x 8 GPUs per node  (one model copy over the nodes" in out
    assert "leader command: vllm serve /models/llama-3.1-405b-instruct" in out
    assert "--node-rank '$(LWS_WORKER_INDEX)'" in out.split("worker command:")[1]
    assert "LeaderWorkerSet/dense-main" in out
    assert main(["plan", "-f", example, "--no-leader-worker-set"]) == 2
    assert "does not serve the LeaderWorkerSet API" in capsys.readouterr().err


def test_plan_warns_on_stderr_and_refuses_what_does_not_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Capacity in the plan a user applies: a batch limit the KV cache cannot fill is a
    warning on stderr (the YAML on stdout stays applyable); weights no GPU holds are refused
    with the numbers and the tensor size that fits."""
    h100 = {"gpuProduct": "NVIDIA-H100-80GB-HBM3"}
    tier = make_tier("main", model="meta-llama/Llama-3.1-70B-Instruct", tensor=2, resources=h100,
                     engine={"maxNumSeqs": 1024})  # fmt: skip
    tier["model"]["maxModelLen"] = 8192
    assert main(["plan", "-f", _write(tmp_path, make_manifest(tiers=[tier]))]) == 0
    out, err = capsys.readouterr()
    assert list(yaml.safe_load_all(out))
    assert "warning:" in err
    assert "tier main / unified: maxNumSeqs 1024 is over 32x" in err
    alone = make_tier("main", model="meta-llama/Llama-3.1-70B-Instruct", resources=h100)
    assert main(["plan", "-f", _write(tmp_path, make_manifest(tiers=[alone]))]) == 2
    err = capsys.readouterr().err
    assert "spec.tiers[0].parallelism.tensor: tier 'main' role unified: 132 GiB" in err
    assert "tensor 2 fits" in err


def test_plan_refuses_a_pod_larger_than_the_node_memory_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--node-memory`: an engine pod asking for more (resources.memory and the host KV tier
    with its margin: 64Gi + 64Gi + 10% = 134.4 GiB) is refused naming engine.kvOffload.size;
    on a larger node, or without the flag, it plans."""
    tier = make_tier("main", engine={"kvOffload": {"size": "64Gi"}})
    path = _write(tmp_path, make_manifest(tiers=[tier]))
    assert main(["plan", "-f", path, "--node-memory", "128Gi"]) == 2
    err = capsys.readouterr().err
    assert "spec.tiers[0].engine.kvOffload.size:" in err
    assert "more than the 128 GiB" in err
    assert main(["plan", "-f", path, "--node-memory", "135Gi"]) == 0
    assert main(["plan", "-f", path]) == 0


def test_invalid_file_names_field_and_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A manifest breaking a rule exits 2 naming the field and the rule's message, with no
    traceback."""
    tier = make_tier("main")
    tier["serving"] = {"replicas": {"min": 5, "max": 2}}
    assert main(["plan", "-f", _write(tmp_path, make_manifest(tiers=[tier]))]) == 2
    err = capsys.readouterr().err
    assert "spec.tiers[0].serving.replicas: replicas.min must be less than" in err
    assert "Traceback" not in err


def test_plan_refusal_is_reported_not_raised(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A refusal only the planner sees (a managed flag in extraArgs) exits 2 with the field, not a
    PlanError traceback."""
    tier = make_tier("main", engine={"extraArgs": ["--port=9000"]})
    assert main(["plan", "-f", _write(tmp_path, make_manifest(tiers=[tier]))]) == 2
    assert "spec.tiers[0].engine.extraArgs[0]: --port is set by fleetpilot" in (
        capsys.readouterr().err
    )


def test_yaml_error_names_the_line_without_traceback(tmp_path: Path) -> None:
    """Run as a user would, in a subprocess, to see exactly what reaches the terminal."""
    path = tmp_path / "broken.yaml"
    path.write_text("apiVersion: fleetpilot.dev/v1alpha1\nkind: InferenceService\nspec: [\n")
    result = subprocess.run(
        [sys.executable, "-m", "fleetpilot", "plan", "-f", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert "YAML syntax error at line 4" in result.stderr
    assert "Traceback" not in result.stderr


def test_plan_reads_standard_input_with_dash() -> None:
    """`kubectl get fpsvc chat -o yaml | fleetpilot plan -f -`: the manifest on stdin, and an
    error in it names <stdin>."""
    manifest = (REPO / "examples" / "two-tier.yaml").read_text()
    result = subprocess.run(
        [sys.executable, "-m", "fleetpilot", "plan", "-f", "-", "-o", "summary"],
        input=manifest,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("InferenceService ml/chat")
    refused = subprocess.run(
        [sys.executable, "-m", "fleetpilot", "plan", "-f", "-"],
        input="kind: InferenceService\nspec: {}\n",
        capture_output=True,
        text=True,
        check=False,
    )
    assert refused.returncode == 2
    assert refused.stderr.startswith("error: <stdin> (document 1): invalid InferenceService")


def test_missing_file_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    """A missing file exits 2 with 'cannot read file', not a FileNotFoundError traceback."""
    assert main(["plan", "-f", "/nonexistent/service.yaml"]) == 2
    assert "cannot read file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["router", "--help"], "usage: fleetpilot router"),
        (["engine", "--backend", "reference", "--help"], "usage: fleetpilot engine --backend ref"),
        (["engine", "--backend", "vllm", "--help"], "usage: fleetpilot engine --backend vllm"),
        (["up", "--help"], "usage: fleetpilot up"),
        (["bench", "--help"], "usage: fleetpilot bench"),
    ],
)
def test_components_parse_their_own_flags(
    argv: list[str], usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Delegated subcommands (router, engine backends, up, bench) reach their own parsers: --help
    shows their usage, not the top-level one."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    assert usage in capsys.readouterr().out


def test_router_with_a_missing_config_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """The router with a missing config file fails naming the path."""
    assert main(["router", "--config", "/nonexistent/router.yaml"]) != 0
    assert "/nonexistent/router.yaml" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["plan", "up"])
def test_an_endless_file_is_refused_at_the_size_limit(command: str) -> None:
    """Regression: `fleetpilot plan -f /dev/zero` grew to 13 GB in 12 s."""
    line = one_line_error(command, "-f", "/dev/zero")
    assert line == (
        "error: /dev/zero: larger than 1048576 bytes (1 MiB), the most a manifest file may be: "
        "is it the right file?"
    )


def test_a_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    """A Latin-1 manifest is one stderr line naming the byte, as a user sees it from a
    subprocess."""
    path = tmp_path / "latin1.yaml"
    path.write_bytes(yaml.safe_dump(make_manifest()).encode() + b"# caf\xe9\n")
    line = one_line_error("plan", "-f", str(path))
    assert line.startswith(f"error: {path}: not UTF-8 text (byte ")


def test_yaml_nested_thousands_deep_is_one_line(tmp_path: Path) -> None:
    """Regression: RecursionError traceback from PyYAML's composer."""
    path = tmp_path / "deep.yaml"
    path.write_text("spec: " + "[" * 5000 + "]" * 5000 + "\n")
    line = one_line_error("plan", "-f", str(path))
    assert line == f"error: {path}: YAML nested deeper than 100 levels (at line 1, column 106)"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["up", "-f", "x.yaml", "--port", "70000"], "--port"),
        (["up", "-f", "x.yaml", "--control-port", "-1"], "--control-port"),
        (["router", "--config", "x.yaml", "--port", "65536"], "--port"),
        (["engine", "--backend", "reference", "--port", "99999"], "--port"),
        (["operator", "--standalone", "--metrics-port", "70000"], "--metrics-port"),
        (
            ["autoscaler", "--fleet", "http://127.0.0.1:1", "--metrics-port", "1e9"],
            "--metrics-port",
        ),
        (["plan", "-f", "x.yaml", "--no-such-flag"], "--no-such-flag"),
        (["plan", "-f", "x.yaml", "--node-memory", "0"], "--node-memory"),
        (["plan", "-f", "x.yaml", "--node-memory", "lots"], "--node-memory"),
    ],
)
def test_bad_flags_are_refused_at_parse_time_in_one_line(argv: list[str], flag: str) -> None:
    """Regression: `up --port 70000` died with an OverflowError traceback after starting."""
    line = one_line_error(*argv)
    assert flag in line
    assert line.startswith("fleetpilot")
    assert ": error: " in line
    assert line.endswith("--help)")


def test_up_with_a_taken_control_port_starts_nothing(tmp_path: Path) -> None:
    """Regression: engines were started, then the control API's bind failed with an OSError
    traceback. Ports are checked before anything starts."""
    import socket

    workdir = tmp_path / "work"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_line_error(
            *("up", "-f", str(REPO / "examples" / "two-tier.yaml"), "--port", "0"),
            *("--control-port", str(port), "--workdir", str(workdir)),
            *("--no-prometheus", "--no-autoscale"),
            returncode=1,
        )
    assert line == (
        f"error: already in use on 127.0.0.1: control API port {port}; stop what uses it or "
        "pick other ports"
    )
    # No child was ever started: no log but up's own.
    assert {log.name for log in (workdir / "logs").glob("*.log")} <= {"up.log"}


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (["operator", "--help"], "/healthz port (0: off) (default: 8080)"),
        (["engine", "--help"], "--backend {reference,vllm}"),
        (["bench", "--help"], "default: 60s when neither it nor"),
        (["router", "--help"], "(default:"),
        (["up", "--help"], "(default:"),
    ],
)
def test_help_shows_defaults_and_choices(
    argv: list[str], shown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a new user reads first: every flag's default, and both engine backends."""
    with pytest.raises(SystemExit):
        main(argv)
    assert shown in " ".join(capsys.readouterr().out.split())


# -- plan -o yaml: what a reviewer diffs -----------------------------------------------------


def test_plan_yaml_has_no_anchors_and_embedded_files_as_blocks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Regression: `plan -o yaml` wrote `&id001`/`*id001` where objects share a mapping, and the
    router ConfigMap's router.yaml as one quoted line of \\n. Each object is spelt out, and an
    embedded file is a literal block whose lines are the file's lines."""
    assert main(["plan", "-f", str(REPO / "examples" / "cpu-two-tier.yaml"), "-o", "yaml"]) == 0
    out = capsys.readouterr().out
    assert "&id" not in out
    assert "*id" not in out
    assert (
        "  router.yaml: |\n    apiVersion: fleetpilot.dev/v1alpha1\n    kind: RouterConfig\n" in out
    )
    assert "  reference-tokenizer.json: |\n    {\n" in out
    # What it reads back as is what the planner made: the same objects, the same strings.
    json_out = main(["plan", "-f", str(REPO / "examples" / "cpu-two-tier.yaml"), "-o", "json"])
    assert json_out == 0
    assert list(yaml.safe_load_all(out)) == json.loads(capsys.readouterr().out)["items"]


def test_review_yaml_keeps_strings_exact_and_unfolded() -> None:
    """A literal block where it holds the text exactly; a quoted string where it cannot (a
    line ending in a space); long lines never folded; shared objects written twice."""
    from fleetpilot.cli import review_yaml

    shared = {"app": "x"}
    long_line = "word " * 40 + "end"
    objects = [
        {"a": shared, "b": shared},
        {"file": "line 1\nline 2\n", "spaced": "trailing \nspace", "long": long_line},
    ]
    text = review_yaml(objects)
    assert "&" not in text
    assert "*" not in text
    assert "file: |\n  line 1\n  line 2\n" in text
    assert 'spaced: "trailing \\nspace"' in text
    assert f"long: {long_line}\n" in text
    assert list(yaml.safe_load_all(text)) == objects


# -- -f as kubectl reads it ------------------------------------------------------------------


NAMESPACE = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "llm"}}


def test_plan_of_a_folder_plans_every_manifest_in_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: `plan -f DIR` said "Is a directory". Its *.yaml, *.yml and *.json files are
    planned in name order; -R reads the folders below too."""
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(make_manifest("b")))
    (tmp_path / "a.json").write_text(json.dumps(make_manifest("a")))
    (tmp_path / "nested").mkdir()
    (tmp_path / "nested" / "c.yml").write_text(yaml.safe_dump(make_manifest("c")))
    assert main(["plan", "-f", str(tmp_path), "-o", "summary"]) == 0
    out = capsys.readouterr().out
    assert "InferenceService ml/a" in out
    assert out.index("InferenceService ml/a") < out.index("InferenceService ml/b")
    assert "ml/c" not in out
    assert main(["plan", "-f", str(tmp_path), "-R", "-o", "summary"]) == 0
    assert "InferenceService ml/c" in capsys.readouterr().out


def test_plan_skips_other_kinds_with_a_note_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: a file with a Namespace before the service was refused. The Namespace is
    skipped with a note on stderr; stdout holds only the plan, for `| kubectl apply -f -`."""
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump_all([NAMESPACE, make_manifest("chat")]))
    assert main(["plan", "-f", str(path), "-o", "json"]) == 0
    captured = capsys.readouterr()
    assert f"note: {path} (document 1): skipped Namespace/llm: not an InferenceService" in (
        captured.err
    )
    assert json.loads(captured.out)["kind"] == "List"


def test_plan_of_a_file_without_a_service_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ns.yaml"
    path.write_text(yaml.safe_dump(NAMESPACE))
    assert main(["plan", "-f", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"error: {path}: no fleetpilot.dev InferenceService in file (it holds Namespace/llm)\n"
    )
    assert captured.out == ""


def test_up_runs_the_one_service_of_a_file_with_other_kinds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`up` reads -f as plan does: a Namespace beside the service is skipped, not counted."""
    from fleetpilot.runtime import up
    from fleetpilot.runtime.stack import LocalStack

    ran: list[str] = []

    def serve(stack: LocalStack, args: object) -> int:
        ran.append(stack.service.name)
        return 0

    monkeypatch.setattr(up, "_serve", serve)
    path = tmp_path / "stack.yaml"
    path.write_text(yaml.safe_dump_all([NAMESPACE, make_manifest("chat", tiers=[make_tier("s")])]))
    argv = ["up", "-f", str(path), "--port", "0", "--workdir", str(tmp_path / "w")]
    argv += ["--no-prometheus"]
    assert main(argv) == 0
    assert ran == ["chat"]
    assert "skipped Namespace/llm" in capsys.readouterr().err


# -- -o is a format --------------------------------------------------------------------------


@pytest.mark.parametrize("output", ["yaml", "json"])
def test_crds_prints_to_stdout_with_o(
    output: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`fleetpilot crds -o yaml | kubectl apply -f -`: the CRD on stdout, nothing written."""
    from fleetpilot.api.crd import crd, render_crd

    monkeypatch.chdir(tmp_path)
    assert main(["crds", "-o", output]) == 0
    out = capsys.readouterr().out
    if output == "yaml":
        assert out == render_crd()
    else:
        assert json.loads(out) == crd()
    assert list(tmp_path.iterdir()) == []  # no crds/ folder written


def test_crds_without_o_still_writes_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What `make crds` runs, and --check with it, as before."""
    from fleetpilot.api.crd import CRD_FILENAME, render_crd

    assert main(["crds", "--out", str(tmp_path)]) == 0
    assert (tmp_path / CRD_FILENAME).read_text() == render_crd()
    assert main(["crds", "--out", str(tmp_path), "--check"]) == 0
    capsys.readouterr()
    assert main(["crds", "--check", "-o", "yaml"]) == 2
    assert "--check compares the file in --out" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["crds", "-o", "crds/"], "-o/--output"),
        (["plan", "-f", "x.yaml", "-o", "out.yaml"], "-o/--output"),
        (["bench", "--duration", "30x"], "--duration"),
        (["up", "-f", "x.yaml", "--duration", "1 min"], "--duration"),
        (["operator", "--standalone", "--lease-duration", "soon"], "--lease-duration"),
    ],
)
def test_formats_and_durations_are_refused_at_parse_time(argv: list[str], flag: str) -> None:
    """`-o` takes a format, never a file name; a duration takes a unit or plain seconds."""
    line = one_line_error(*argv)
    assert f"argument {flag}: " in line
    assert line.endswith("--help)")


def test_operator_lease_duration_takes_a_duration() -> None:
    from fleetpilot.cli import build_parser

    args = build_parser().parse_args(["operator", "--lease-duration", "1m"])
    assert args.lease_duration == 60.0
    assert build_parser().parse_args(["operator", "--lease-duration=15"]).lease_duration == 15.0


@pytest.mark.parametrize("value", ["2s", "15500ms"])
def test_operator_refuses_a_lease_a_kubernetes_lease_cannot_hold(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Lease counts whole seconds, and the election needs at least 3 of them: refused
    before the operator imports kopf or listens on a port."""
    argv = ["operator", "--standalone", "--leader-election", "--namespace", "ns"]
    assert main([*argv, "--lease-duration", value]) == 2
    assert "--lease-duration must be whole seconds, at least 3s" in capsys.readouterr().err


# -- engine --help names both backends' flags ------------------------------------------------


@pytest.mark.parametrize("backend", [[], ["--backend", "vllm"], ["--backend", "reference"]])
def test_engine_help_lists_both_backends_flags(
    backend: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: `engine --help` showed the vLLM launcher's flags only."""
    with pytest.raises(SystemExit) as info:
        main(["engine", *backend, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ["--launch-json", "--dry-run", "--worker"]:  # the vLLM launcher's
        assert flag in out
    for flag in ["--kv-offloading-size", "--model-config", "--cold-start-seconds"]:  # reference's
        assert flag in out
    chosen = backend[1] if backend else "vllm"
    other = "reference" if chosen == "vllm" else "vllm"
    assert f"usage: fleetpilot engine --backend {chosen}" in out
    assert f"--backend {other} options:" in out


def test_engine_help_says_when_the_other_backend_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The vLLM image may lack the reference engine's packages: help still works, and says so."""
    import importlib

    from fleetpilot import cli

    real = importlib.import_module

    def missing(name: str, package: str | None = None) -> object:
        if name == cli.ENGINE_BACKENDS["reference"]:
            raise ImportError("No module named 'torch'")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(SystemExit):
        main(["engine", "--help"])
    out = capsys.readouterr().out
    assert "--backend reference options: not shown, its packages are not installed" in out
    assert "(No module named 'torch')" in out
    assert "--launch-json" in out


# -- broken pipes are quiet ------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "-f", str(REPO / "examples" / "cpu-two-tier.yaml"), "-o", "json"],
        ["plan", "-f", str(REPO / "examples" / "cpu-two-tier.yaml"), "-o", "yaml"],
        ["crds", "-o", "yaml"],
    ],
)
def test_a_reader_that_closes_early_ends_the_command_quietly(argv: list[str]) -> None:
    """Regression: `plan -o json | head -1` ended in a BrokenPipeError traceback. The reader
    here closes before a byte is written, so the write always meets a closed pipe: exit 141
    as a shell reports kubectl (ended by SIGPIPE), and nothing on stderr."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "fleetpilot", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert result.stderr == ""
    assert result.returncode == 141


def test_head_reads_the_first_line_and_the_rest_is_dropped_quietly() -> None:
    """As a user types it: `fleetpilot plan -o json | head -1`."""
    plan = [sys.executable, "-m", "fleetpilot", "plan", "-o", "json"]
    plan += ["-f", str(REPO / "examples" / "cpu-two-tier.yaml")]
    producer = subprocess.Popen(plan, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert producer.stdout is not None
    assert producer.stderr is not None
    first = producer.stdout.readline()
    producer.stdout.close()  # `head -1` exits
    err = producer.stderr.read().decode()
    producer.stderr.close()
    assert producer.wait(timeout=120) in (0, 141)  # 0: it had written everything already
    assert first == b"{\n"
    assert "Traceback" not in err
    assert "BrokenPipeError" not in err


def test_a_broken_pipe_that_is_not_stdout_is_not_swallowed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only stdout's reader leaving is quiet: a broken pipe elsewhere (a socket a command
    writes to) is a fault, raised as one."""
    from fleetpilot import cli

    def broken(args: object) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setitem(cli.LAZY_COMMANDS, "bench", broken)
    monkeypatch.setattr(cli, "_stdout_reader_gone", lambda: False)
    with pytest.raises(BrokenPipeError):
        main(["bench"])
