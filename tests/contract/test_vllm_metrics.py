"""The metrics fleetpilot reads are vLLM's, and the reference engine exports them as vLLM does.

vLLM's side is taken from its own Prometheus logger (``PrometheusStatLogger``), registered for
an engine configured the way ``vllm serve`` configures one (a local checkpoint the test
writes), not from a list kept here. fleetpilot's side is every ``vllm:`` name its readers hold
(the router's scrape, the autoscaler's PromQL), found in their source. The reference engine's
side is its live ``/metrics`` after real requests.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import fleetpilot
from fleetpilot.routing.policies.load import parse_engine_metrics
from fleetpilot.testing.engine_server import BackgroundServer
from tests.contract.conftest import VllmJudge
from tests.contract.metric_families import summarize

PACKAGE = Path(fleetpilot.__file__).resolve().parent
MODEL = "tiny-model"
MAX_MODEL_LEN = "256"
NUM_GPU_BLOCKS = 64
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}
# Names read only as a fallback for engines older than the pinned release; each must be gone
# from the pinned vLLM (else the fallback is the name to read) and its successor read too.
OLDER_VLLM_NAMES = {"vllm:gpu_cache_usage_perc": "vllm:kv_cache_usage_perc"}  # renamed in v0.10
METRIC_NAMES = Path(__file__).with_name("metric_names.py")
# Parsing fleetpilot's few hundred files takes about a second; a loaded 2-core machine, ten.
SCAN_TIMEOUT_S = 120
Families = dict[str, dict[str, Any]]


# What reads only the reference engine's own metrics, never a vLLM engine's: the simulator's
# calibration, which measures the reference engine (its KV pool from the reference engine's
# deliberately smaller vllm:cache_config_info).
REFERENCE_ONLY_READERS = {PACKAGE / "simulate" / "calibrate_http.py"}


@functools.cache
def names_fleetpilot_reads() -> frozenset[str]:
    """Every string constant that is a whole ``vllm:`` metric name in fleetpilot's source,
    outside the reference engine (which writes them; it does not read them) and what reads
    only the reference engine (``REFERENCE_ONLY_READERS``).

    Parsed in a process of its own (``metric_names.py``): ``ast.parse`` in this process would
    race any thread an earlier test left that parses too (python/cpython#106905)."""
    exporter = PACKAGE / "engine" / "reference"
    skip = [str(path) for path in (exporter, *REFERENCE_ONLY_READERS)]
    scan = subprocess.run(
        [sys.executable, str(METRIC_NAMES), str(PACKAGE), *skip],
        capture_output=True,
        text=True,
        timeout=SCAN_TIMEOUT_S,
        check=False,
    )
    assert scan.returncode == 0, scan.stderr
    return frozenset(json.loads(scan.stdout))


def family_of(name: str, families: Families) -> str | None:
    """The family a read series belongs to: itself, or the family exposing it as a sample
    (``_total`` of a counter, ``_bucket``/``_count``/``_sum`` of a histogram)."""
    if name in families:
        return name
    return next((f for f, info in families.items() if name in info["samples"]), None)


def exposed_families(text: str) -> Families:
    """The reference engine's ``/metrics`` in the judge's shape."""
    return summarize(text_string_to_metric_families(text))


@pytest.fixture(scope="module")
def vllm_families(vllm_judge: VllmJudge, tiny_checkpoint: Path) -> Families:
    """What vLLM registers for an engine like the reference one: a tiny Llama checkpoint with
    the reference tokenizer, served under one name, with ngram speculation (its counters) and
    LoRA on (vllm:lora_requests_info, which the router reads)."""
    argv = [str(tiny_checkpoint), "--served-model-name", MODEL, "--max-model-len", MAX_MODEL_LEN,
            "--speculative-config", json.dumps(SPECULATIVE), "--enable-lora"]  # fmt: skip
    answer = vllm_judge.ask({"op": "metrics", "argv": argv, "num_gpu_blocks": NUM_GPU_BLOCKS})
    assert answer["ok"], answer["error"]
    families: Families = answer["families"]
    return families


@pytest.fixture(scope="module")
def reference_families() -> Iterator[Families]:
    """The reference engine's families after two completions (the second hits the cache)."""
    server = BackgroundServer.from_argv(
        ["--host", "127.0.0.1", "--port", "0", "--model-config", "tiny",
         "--max-model-len", MAX_MODEL_LEN, "--served-model-name", MODEL,
         "--num-gpu-blocks-override", str(NUM_GPU_BLOCKS),
         "--speculative-config", '{"num_speculative_tokens": 2, "draft_num_layers": 1}',
         "--enable-lora"]
    ).start()  # fmt: skip
    try:
        prompt = "The quick brown fox jumps over the lazy dog, again and again and again."
        for _ in range(2):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            httpx.post(server.url + "/v1/completions", json=body, timeout=30).raise_for_status()
        yield exposed_families(httpx.get(server.url + "/metrics", timeout=30).text)
    finally:
        server.stop()


def test_fleetpilot_reads_metrics_of_its_own(vllm_families: Families) -> None:
    """The scan finds the readers' names (a moved module would make the tests below vacuous)."""
    read = names_fleetpilot_reads()
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:time_to_first_token_seconds", "vllm:prefix_cache_hits_total"} <= read  # fmt: skip
    assert len(vllm_families) > 20
    assert all(path.is_file() for path in REFERENCE_ONLY_READERS)


def _parse_until(stop: threading.Event, source: str) -> None:
    """What a thread an earlier test left may do: parse (a logged traceback does, in 3.11)."""
    while not stop.is_set():
        with contextlib.suppress(SystemError):  # this thread's own parse may lose the race
            ast.parse(source)


def _python_code_at_every_collection(phase: str, info: dict[str, int]) -> None:
    """A gc callback (as a finalizer would be): Python code run inside one thread's
    ``ast.parse`` whenever it triggers a collection, where the interpreter may switch threads."""


def test_the_scan_is_unharmed_by_a_thread_that_parses_beside_it() -> None:
    """Regression (issue 41, probe 6): the scan of fleetpilot's source failed once in a full
    run with ``SystemError: AST constructor recursion depth mismatch``, because another
    thread parsed at the same time (python/cpython#106905). With a thread parsing in a loop
    and the interpreter switching threads as often as it can, the scan still finds the names,
    every time."""
    source = Path(ast.__file__).read_text()
    stop = threading.Event()
    parser = threading.Thread(target=_parse_until, args=(stop, source), daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    gc.callbacks.append(_python_code_at_every_collection)
    parser.start()
    try:
        for _ in range(3):
            names_fleetpilot_reads.cache_clear()
            assert "vllm:num_requests_waiting" in names_fleetpilot_reads()
    finally:
        stop.set()
        parser.join(timeout=30)
        gc.callbacks.remove(_python_code_at_every_collection)
        sys.setswitchinterval(interval)
    assert not parser.is_alive()


def test_every_metric_fleetpilot_reads_is_one_vllm_exports(vllm_families: Families) -> None:
    """A name the router or the autoscaler reads that the pinned vLLM does not export would
    leave a fleet blind (no scaling, no load-aware routing) without any error."""
    missing = sorted(
        name
        for name in names_fleetpilot_reads()
        if name not in OLDER_VLLM_NAMES and family_of(name, vllm_families) is None
    )
    assert not missing, f"fleetpilot reads metrics the pinned vLLM lacks: {missing}"
    for old, new in OLDER_VLLM_NAMES.items():
        assert family_of(old, vllm_families) is None, f"{old} is exported again: read it"
        assert family_of(new, vllm_families) is not None


def test_the_reference_engine_exports_them_with_vllms_type_labels_and_buckets(
    vllm_families: Families, reference_families: Families
) -> None:
    """For every metric fleetpilot reads, the reference engine has vLLM's family: the same
    type, label names and histogram buckets, so what is tested on a CPU reads a GPU fleet."""
    for name in sorted(names_fleetpilot_reads() - OLDER_VLLM_NAMES.keys()):
        family = family_of(name, vllm_families)
        assert family is not None
        theirs = vllm_families[family]
        ours = reference_families.get(family)
        assert ours is not None, f"the reference engine does not export {family}"
        for key in ("type", "labels", "buckets"):
            assert ours[key] == theirs[key], (family, key, ours[key], theirs[key])


def test_whatever_the_reference_engine_exports_under_vllms_names_is_vllms(
    vllm_families: Families, reference_families: Families
) -> None:
    """The reference engine claims vLLM's names for all it exports (dashboards read them
    too): each such family is vLLM's, with its type, labels and buckets."""
    assert reference_families
    for family, ours in sorted(reference_families.items()):
        theirs = vllm_families.get(family)
        assert theirs is not None, f"the reference engine exports {family}, vLLM does not"
        assert (ours["type"], ours["buckets"]) == (theirs["type"], theirs["buckets"]), family
        if family.endswith("_info"):
            # An info gauge labelled with a config: vLLM's has every field of it, ours those
            # the reference engine has, each under vLLM's name.
            assert set(ours["labels"]) <= set(theirs["labels"]), (family, ours, theirs)
        else:
            assert ours["labels"] == theirs["labels"], (family, ours, theirs)


def test_the_router_reads_the_adapters_vllm_reports_running(
    vllm_judge: VllmJudge, tiny_checkpoint: Path
) -> None:
    """vLLM's own logger, after three scheduler steps with different LoRA adapters running
    and waiting, exposes a vllm:lora_requests_info series for each set it saw; the router's
    parser reads the adapters of the last step from that text (the newest series), not a
    union of all, not the first."""
    argv = [str(tiny_checkpoint), "--served-model-name", MODEL, "--max-model-len", MAX_MODEL_LEN,
            "--enable-lora", "--max-loras", "2"]  # fmt: skip
    snapshots = [
        {"running": ["sql", "legal"], "waiting": []},
        {"running": ["tax"], "waiting": ["sql"]},
        {"running": ["team/a:v2"], "waiting": ["poetry"]},
    ]
    answer = vllm_judge.ask({"op": "lora_info", "argv": argv, "snapshots": snapshots})
    assert answer["ok"], answer["error"]
    text: str = answer["text"]
    series = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(series) == 3  # vLLM keeps every set it reported
    metrics = parse_engine_metrics(text)
    assert metrics is not None
    assert metrics.adapters == {"team/a:v2", "poetry"}
