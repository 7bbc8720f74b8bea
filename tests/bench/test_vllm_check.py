"""The GPU check (``bench/gpu/vllm_check.py``) on this CPU: its checkpoint, its parsers, a run.

What a GPU machine runs unchanged must be right before one is lent: the checkpoint and
tokenizer it serves, how it reads ``/metrics``, route headers and usage (a missing metric, a
header without ``prefix-match``, a disagreeing prediction, a P/D answer without its prefill
hop must each fail), and the whole script end to end with CPU reference engines.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.gpu import vllm_check as check
from fleetpilot.engine.reference.checkpoint import load_checkpoint
from fleetpilot.engine.reference.model import LlamaModel
from fleetpilot.engine.reference_launch import REFERENCE_TOKENIZER
from fleetpilot.routing.tokenizer.request import RequestTokenizer

SCRIPT = Path(check.__file__)
# A vLLM engine's page, trimmed: labelled histograms, counters and gauges as vLLM writes them.
LABELS = 'engine="0",model_name="check-unified"'
VLLM_PAGE = f"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{{LABELS}}} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{LABELS}}} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{LABELS}}} 0.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{{LABELS}}} 4424.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{{LABELS}}} 2928.0
# HELP vllm:external_prefix_cache_queries_total External prefix cache queries from KV connector.
# TYPE vllm:external_prefix_cache_queries_total counter
vllm:external_prefix_cache_queries_total{{{LABELS}}} 0.0
# HELP vllm:external_prefix_cache_hits_total External prefix cache hits from KV connector.
# TYPE vllm:external_prefix_cache_hits_total counter
vllm:external_prefix_cache_hits_total{{{LABELS}}} 0.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{{{LABELS},finished_reason="stop"}} 0.0
vllm:request_success_total{{{LABELS},finished_reason="length"}} 4.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{{LABELS},le="0.001"}} 0.0
vllm:time_to_first_token_seconds_bucket{{{LABELS},le="0.04"}} 4.0
vllm:time_to_first_token_seconds_bucket{{{LABELS},le="+Inf"}} 4.0
vllm:time_to_first_token_seconds_count{{{LABELS}}} 4.0
vllm:time_to_first_token_seconds_sum{{{LABELS}}} 0.061
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{{{LABELS},le="0.01"}} 28.0
vllm:inter_token_latency_seconds_bucket{{{LABELS},le="+Inf"}} 28.0
vllm:inter_token_latency_seconds_count{{{LABELS}}} 28.0
vllm:inter_token_latency_seconds_sum{{{LABELS}}} 0.09
"""
UNIFIED_ROUTE = (
    "tier=unified; replica=127.0.0.1:41001; prefix-match={match}; prefix-source=events; "
    "reason=header"
)
PD_ROUTE = (
    "tier=pd; replica=127.0.0.1:41005; prefix-match=0.00; prefix-source=events; "
    "reason=header; prefill={prefill}"
)


def answer(prompt_tokens: int, cached: int | None, text: str = "x y z") -> dict[str, Any]:
    """A /v1/completions body; ``cached`` None: usage without prompt_tokens_details."""
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 8,
        "total_tokens": prompt_tokens + 8,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {"object": "text_completion", "choices": [{"index": 0, "text": text}], "usage": usage}


def observation(match: str, prompt_tokens: int, cached: int | None) -> check.PrefixObservation:
    return check.observe(UNIFIED_ROUTE.format(match=match), answer(prompt_tokens, cached))


# ---- the checkpoint -------------------------------------------------------------------------


def test_the_checkpoint_loads_back_with_the_tokenizer_beside_it(tmp_path: Path) -> None:
    """The folder the check serves is the reference engine's own checkpoint of the check's
    model (head size 64, seeded: the same weights every run), with the shipped tokenizer files
    beside it, which the router loads from that folder."""
    folder = check.write_checkpoint(tmp_path / "model")
    model = load_checkpoint(folder)
    assert model.config == check.CHECK_MODEL
    assert model.config.head_dim == 64
    again = dict(LlamaModel(check.CHECK_MODEL).named_weights())
    for name, weight in model.named_weights():
        assert torch.equal(weight, again[name]), name
    shipped = sorted(REFERENCE_TOKENIZER.glob("*.json"))
    assert {f.name for f in shipped} >= {"tokenizer.json", "tokenizer_config.json"}
    for file in shipped:
        assert (folder / file.name).read_bytes() == file.read_bytes()
    payload = {"prompt": "hello"}
    assert RequestTokenizer.from_dir(folder).token_ids("completions", payload) == (
        RequestTokenizer.from_dir(REFERENCE_TOKENIZER).token_ids("completions", payload)
    )


# ---- /metrics -------------------------------------------------------------------------------


def test_the_metric_names_are_the_autoscalers() -> None:
    """The names checked are the autoscaler's MetricNames defaults, histograms included."""
    names = check.autoscaler_metric_names()
    assert "vllm:time_to_first_token_seconds" in names
    assert "vllm:prefix_cache_hits_total" in names
    assert all(name.startswith("vllm:") for name in names)


def test_every_metric_read_on_a_vllm_page_passes() -> None:
    """A page with every name read passes; histograms count by their _count, labelled
    counters by the sum of their series, and zero gauges are recorded as zero."""
    result = check.metrics_check({"unified/unified#0": VLLM_PAGE}, check.autoscaler_metric_names())
    assert result.status == check.PASS, result.reason
    seen = result.details["engines"]["unified/unified#0"]
    assert "vllm:num_requests_waiting" in seen["zero"]
    assert "vllm:time_to_first_token_seconds" in seen["nonzero"]
    assert "vllm:request_success_total" in seen["nonzero"]
    assert check.counter_total(VLLM_PAGE, "vllm:request_success_total") == 4.0


def test_a_missing_metric_fails_and_names_the_engine() -> None:
    """An engine without one of the names read fails the check, saying which and where."""
    page = "\n".join(line for line in VLLM_PAGE.splitlines() if "kv_cache_usage" not in line)
    names = check.autoscaler_metric_names()
    result = check.metrics_check({"pd/decode#0": page + "\n"}, names)
    assert result.status == check.FAIL
    assert result.reason == "missing: pd/decode#0: vllm:kv_cache_usage_perc"
    assert check.metrics_check({}, names).status == check.FAIL


def test_names_with_escaped_colons_count() -> None:
    """A page written with ':' as '_' (an OpenMetrics scrape without UTF-8 escaping) holds
    the same series: the autoscaler reads both spellings, so the check does too."""
    escaped = VLLM_PAGE.replace("vllm:", "vllm_")
    result = check.metrics_check({"e": escaped}, check.autoscaler_metric_names())
    assert result.status == check.PASS, result.reason


# ---- prefix hits ----------------------------------------------------------------------------


def test_router_and_engine_agreeing_on_a_shared_prefix_pass() -> None:
    """A cold request (0 predicted, 0 cached) then warm ones where the router's prefix-match
    of the prompt's 66 full blocks matches the engine's cached_tokens within a block."""
    observations = [
        observation("0.00", 1063, None),  # vLLM leaves out details when nothing was cached
        observation("0.94", 1063, 992),  # 62.04 blocks predicted, 62 cached
        observation("0.95", 1062, 1008),  # 62.7 predicted, 63 cached
    ]
    result = check.prefix_check(observations, 16, {"hits": 2000.0, "queries": 3188.0})
    assert result.status == check.PASS, result.reason
    rows = result.details["requests"]
    assert [row["agree"] for row in rows] == [True, True, True]
    assert rows[1]["router_blocks"] == 62.04
    assert rows[1]["prefix_source"] == "events"


def test_a_disagreeing_prediction_fails() -> None:
    """The router predicting the whole prefix where the engine recomputed it is a failure."""
    observations = [observation("0.00", 1063, 0), observation("0.94", 1063, 16)]
    result = check.prefix_check(observations, 16, {"hits": 16.0, "queries": 2126.0})
    assert result.status == check.FAIL
    assert "disagree on requests [1]" in result.reason


def test_a_route_header_without_prefix_match_fails() -> None:
    """A router that sends no prefix-match (or no header at all) fails the comparison."""
    no_match = check.observe("tier=unified; reason=header", answer(1063, 992))
    no_header = check.observe(None, answer(1063, 992))
    for observations in ([no_match], [observation("0.00", 1063, 0), no_header]):
        result = check.prefix_check(observations, 16, {"hits": 992.0})
        assert result.status == check.FAIL
        assert result.reason == "no prefix-match in the router's x-fleetpilot-route header"
    assert check.compare_prefix(no_match, 16)["agree"] is False


def test_an_engine_reporting_no_cached_tokens_fails() -> None:
    """Usage without cached_tokens on every warm request says the engine does not report
    them (vLLM without --enable-prompt-tokens-details), which the check must not pass."""
    observations = [observation("0.00", 1063, None), observation("0.00", 1063, None)]
    result = check.prefix_check(observations, 16, {"hits": 0.0})
    assert result.status == check.FAIL
    assert "--enable-prompt-tokens-details" in result.reason


def test_counters_that_did_not_move_fail() -> None:
    """Agreeing answers while the engines' prefix_cache_hits counter stayed put fail."""
    observations = [observation("0.00", 1063, None), observation("0.94", 1063, 992)]
    result = check.prefix_check(observations, 16, {"hits": 0.0, "queries": 2126.0})
    assert result.status == check.FAIL
    assert "prefix_cache_hits" in result.reason


# ---- the P/D hop ----------------------------------------------------------------------------


def test_a_prefilled_answer_passes() -> None:
    """200 with text, the header naming the prefill replica, the decode engine reporting the
    prompt as cached (its KV came from prefill): the hop works."""
    route = PD_ROUTE.format(prefill="127.0.0.1:41003")
    result = check.pd_check(200, route, answer(641, 640))
    assert result.status == check.PASS, result.reason
    assert result.details["prefill"] == "127.0.0.1:41003"
    assert "640 of 641" in result.reason


def test_pd_failures_each_say_why() -> None:
    """No prefill hop, an error status, an empty answer, or a decode that recomputed the
    prompt each fail; an engine that does not report cached tokens passes, saying so."""
    hop = PD_ROUTE.format(prefill="127.0.0.1:41003")
    cases = [
        (200, PD_ROUTE.format(prefill="none"), answer(641, 640), "prefill hop did not run"),
        (200, "tier=pd; reason=header", answer(641, 640), "prefill hop did not run"),
        (503, hop, None, "HTTP 503"),
        (200, hop, answer(641, 640, text=""), "no content"),
        (200, hop, answer(641, 0), "computed the whole prompt again"),
    ]
    for status, route, body, reason in cases:
        result = check.pd_check(status, route, body)
        assert result.status == check.FAIL
        assert reason in result.reason
    unobserved = check.pd_check(200, hop, answer(641, None))
    assert unobserved.status == check.PASS
    assert "not observable" in unobserved.reason


# ---- the load, the table, vLLM's environment ------------------------------------------------


def test_bench_summaries() -> None:
    """A clean load with prefix hits passes; errors, no success or no hits fail."""
    summary = {
        "requests": 120, "succeeded": 120, "errors": {},
        "ttft_s": {"p50": 0.012, "p95": 0.031, "p99": 0.04},
        "prompt_tokens": 160000, "cached_tokens": 140000, "throughput_rps": 2.0,
    }  # fmt: skip
    result = check.bench_check(summary)
    assert result.status == check.PASS, result.reason
    assert result.reason.startswith("120 requests, TTFT p50 12ms p95 31ms")
    assert result.details["ttft_p95_s"] == 0.031
    for change in ({"errors": {"HTTP 503": 2}}, {"succeeded": 0}, {"cached_tokens": 0}):
        assert check.bench_check(summary | change).status == check.FAIL


def test_the_table_has_a_line_per_check() -> None:
    """The closing table: a header, then each check's name, status and reason."""
    checks = {
        "flags": check.Check(check.PASS, "3 engines up").to_json(),
        "pd": check.skipped(check.NO_NIXL).to_json(),
    }
    assert checks["pd"]["skipped"] == "nixl is not installed in the vLLM environment"
    lines = check.format_table(checks).splitlines()
    assert lines[0].split() == ["CHECK", "STATUS", "REASON"]
    assert lines[1].split()[:2] == ["flags", "pass"]
    assert lines[2].split()[:2] == ["pd", "skip"]


def test_vllms_python_is_read_from_its_script(tmp_path: Path) -> None:
    """The interpreter of a pip-installed ``vllm`` script is its #! line; a trampoline or a
    missing script falls back to the python beside it."""
    script = tmp_path / "bin" / "vllm"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\nimport sys\n")
    assert check.vllm_python(str(script)) == sys.executable
    script.write_text('#!/bin/sh\n\'\'\'exec\' "/very long/python" "$0" "$@"\n')
    assert check.vllm_python(str(script)) == str(tmp_path / "bin" / "python")
    assert check.vllm_python(str(tmp_path / "nowhere")) == str(tmp_path / "python")


def test_an_environment_without_nixl_is_reported() -> None:
    """This virtualenv has no NIXL: the probe says why instead of raising."""
    problem = check.nixl_problem(sys.executable)
    assert problem is not None
    assert "nixl" in problem


# ---- end to end -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The script as a GPU machine runs it, with reference engines and a 5 s load."""
    out = tmp_path_factory.mktemp("gpu-check")
    argv = [sys.executable, str(SCRIPT), "--out", str(out), "--backend", "reference"]
    done = subprocess.run(
        [*argv, "--duration", "5"], capture_output=True, text=True, timeout=300, check=False
    )
    results: dict[str, Any] = json.loads((out / "results.json").read_text())
    assert done.returncode == 0, done.stdout + done.stderr
    results["stdout"] = done.stdout
    return results


def test_the_check_passes_against_reference_engines(reference_run: dict[str, Any]) -> None:
    """Every check passes with reference engines of the check's model: three engines came
    up, the router's prefix predictions match the engine's cached tokens, the P/D hop ran,
    the load and the autoscaler's metrics are there, and no process is left."""
    checks = reference_run["checks"]
    assert list(checks) == ["flags", "prefix", "pd", "bench", "metrics"]
    assert {name: c["status"] for name, c in checks.items()} == dict.fromkeys(checks, "pass"), (
        json.dumps(checks, indent=1)[:4000]
    )
    assert reference_run["passed"] is True
    assert reference_run["leftover_pids"] == []
    engines = {e["engine"]: e["argv"] for e in checks["flags"]["engines"]}
    assert sorted(engines) == ["pd/decode#0", "pd/prefill#0", "unified/unified#0"]
    config = engines["unified/unified#0"][engines["unified/unified#0"].index("--model-config") + 1]
    assert json.loads(config)["head_dim"] == 64
    assert set(checks["metrics"]["engines"]) == set(engines)
    assert "CHECK    STATUS  REASON" in reference_run["stdout"]
