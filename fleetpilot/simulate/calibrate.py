"""``fleetpilot simulate calibrate``: measure the reference engine on this machine, as the local
fleet (``fleetpilot up``) runs it, and write the
:class:`~fleetpilot.simulate.profile.MeasuredProfile` the simulator times engines with.

Every engine is started with the local fleet's own command line
(:func:`~fleetpilot.engine.reference_launch.reference_argv`: the tiny model, 16 sequences, 2048
tokens of context, the engine's default token budget (512) and block size (16), prefix caching
and KV events on) and measured over HTTP with the load generator ``fleetpilot bench`` uses,
because that is what the profile must predict: an engine serving HTTP spends a large share of a
step on its event loop (an SSE write per token per stream, on the same GIL as the step); on a
2-core machine a 16-sequence decode step took ~6 ms driven in-process and ~10 ms serving.

* Step costs: a *step recorder*
  (:mod:`~fleetpilot.simulate.calibrate_record` run as ``python -m``) serves exactly as
  ``fleetpilot engine --backend reference`` does with the same flags, but wraps the engine's
  ``step`` and its scheduler's ``schedule`` from outside to note, per step, what ran (decoding
  sequences, their KV tokens, prompt tokens computed) and when it started. A step's cost is the
  time to the next step's start while the engine stays busy: the step plus the runner's work
  around it (metrics, KV events, handing outputs to the event loop), which is what separates
  two tokens of a stream. Closed-loop loads of 1..16 concurrent chats with short to long
  prompts and varied answer lengths give decode-only, prefill-only and mixed steps, and loads
  of short and longer questions after a shared (so cached) prefix give prompts that attend to
  a cached prefix; :func:`fit_step_costs` fits the six step coefficients to them
  (non-negative least squares on relative error, gross outliers dropped). Without the two
  attention terms a 40-token question after a 1,200-token cached prefix was priced as a
  40-token prompt alone: 4 ms, where the engine took 7.4.
* ``prefill_base_s``: what the client's TTFT (first non-empty content, as ``fleetpilot bench``
  measures it) of a lone request has beyond the engine's own (its
  ``vllm:time_to_first_token_seconds``, read before and after each request): the chat template
  and tokenizer before the engine's clock starts, the SSE write and the client's read after
  it; the median, floored at 0. With a byte tokenizer and a random model the first token is
  sometimes a held-back partial UTF-8 character, so this also carries the mean delay that
  causes. (It was once the TTFT minus the *modeled* prefill, which let the step fit's error
  on lone prompts stand in for the served path: 1.1 ms, where the engines' own clock says
  4-5 ms.)
* ``first_token_per_stream_s``: that gap grows with the streams the engine serves beside the
  request (their token writes share the engine's event loop, and the client's): each
  closed-loop load's mean client TTFT minus the engine's mean over the same requests, beyond
  ``prefill_base_s``, fitted per other stream (concurrency - 1) through the origin.
* ``transfer_per_token_s``: the router's P/D hand-off (the prefill hop, then the decode hop,
  which pulls the pinned KV over HTTP); the recorder runs with a P/D role's flags
  (``kv_both``), so it serves both hops. The decode hop's TTFT minus what it costs without a
  pull (a one-token step and ``prefill_base_s``), fitted per prompt token through the origin,
  so a pull's fixed cost is spread over typical prompt lengths.
* ``router_s`` (the profile's, not an engine cost): the local fleet's smallest service (one
  reference engine, ``fleetpilot router`` before it, started as ``fleetpilot up`` starts
  them) answers lone requests through the router and straight to the engine, alternately;
  the median difference of their TTFTs. The simulated routers decide for free; this is their
  hop on the client's clock.
* Lone requests and hand-offs run between the loads, not after them: a shared CPU's speed
  drifts by tens of percent within a minute, and both coefficients are differences against the
  step fit, so they must see the same machine.
* ``cold_start_s``: launch of the real command to ``/health`` answering 200, polled as the local
  fleet polls it; the median of three starts (``quick``: the step recorder's own launch).
* Shape: the KV pool (blocks x block size), batch limits and block size the recorder's engine
  was built with, checked against what the real command's engine reports in ``/metrics``;
  ``chars_per_token`` and ``message_tokens`` are fitted to how the engine's ``/tokenize`` counts
  the ``fleetpilot bench`` workloads' chats: bytes of content per token, and the tokens its chat
  template adds a message (the simulator's tokenizer counts a chat that way).

Nothing here imports torch: engines run in child processes (the runtime's supervisor, so none
outlives the calibration).

The modules, one job each: :mod:`~fleetpilot.simulate.calibrate_plan` (what is measured),
:mod:`~fleetpilot.simulate.calibrate_measure` (the driver: child processes, the plan, the fits in
order), :mod:`~fleetpilot.simulate.calibrate_http` (its requests and what the engines report),
:mod:`~fleetpilot.simulate.calibrate_record` (the step recorder, in the engine's process),
:mod:`~fleetpilot.simulate.calibrate_fit` (the fits, pure); this one is the command line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from fleetpilot.simulate.calibrate_fit import prefill_s
from fleetpilot.simulate.calibrate_http import CalibrationError
from fleetpilot.simulate.calibrate_measure import Calibration, measure


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # --out, as fleetpilot bench's: -o/--output is an output format across the CLI family.
    parser.add_argument(
        "--out", required=True, type=Path, metavar="FILE", help="where to write the profile (JSON)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a few samples of each kind (seconds): checks the machinery, not a profile to trust",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the calibration prompts")


def run(args: argparse.Namespace) -> int:
    """Measure, write the profile, print the coefficients and how well they fit."""
    try:
        calibration = measure(
            seed=args.seed,
            quick=args.quick,
            progress=lambda message: print(message, file=sys.stderr, flush=True),
        )
    except CalibrationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    args.out.write_text(json.dumps(calibration.profile.to_json(), indent=2) + "\n")
    print(report(calibration))
    print(f"wrote {args.out}")
    return 0


def report(c: Calibration) -> str:
    """The coefficients, and how well each part of the model fits what was measured."""
    costs, shape, fit = c.profile.costs, c.profile.shape, c.fit
    lines = [
        f"profile {c.profile.name}: {c.profile.source}",
        f"measured in {c.elapsed_s:.0f} s",
        "",
        f"step costs: {fit.steps} steps ({fit.dropped} outliers dropped), R^2 {fit.r2:.3f}",
        f"  decode_base_s          {costs.decode_base_s:.6g}",
        f"  decode_per_seq_s       {costs.decode_per_seq_s:.6g}",
        f"  decode_per_kv_token_s  {costs.decode_per_kv_token_s:.6g}",
        f"  prefill_per_token_s    {costs.prefill_per_token_s:.6g}",
        f"  prefill_per_context_token_s {costs.prefill_per_context_token_s:.6g}",
        f"  prefill_per_pair_s     {costs.prefill_per_pair_s:.6g}",
        "  step kind   steps  measured ms  model ms  median |error|",
    ]
    for r in fit.residuals:
        lines.append(
            f"  {r.kind:<9} {r.steps:>7}  {r.measured_s * 1e3:>11.2f}  {r.model_s * 1e3:>8.2f}"
            f"  {r.median_rel_error:>13.1%}"
        )
    max_batched = shape.max_num_batched_tokens
    ttft_errors = [
        abs(prefill_s(fit, s.prompt_tokens - s.cached_tokens, max_batched, s.cached_tokens)
            + costs.prefill_base_s - s.ttft_s) / s.ttft_s
        for s in c.ttft
    ]  # fmt: skip
    pull_errors = [
        abs(
            costs.decode_hop_s(s.prompt_tokens)
            + costs.prefill_base_s
            + costs.transfer_per_token_s * s.prompt_tokens
            - s.ttft_s
        )
        / s.ttft_s
        for s in c.pulls
    ]
    by_streams: dict[int, list[float]] = {}
    for g in c.gaps:
        by_streams.setdefault(g.concurrency, []).append(g.client_mean_s - g.engine_mean_s)
    lines += [
        "",
        f"prefill_base_s         {costs.prefill_base_s:.6g}  (client minus engine TTFT, median "
        f"over {len(c.ttft)} lone requests; TTFT median |error| "
        f"{statistics.median(ttft_errors):.1%})",
        f"first_token_per_stream_s {costs.first_token_per_stream_s:.6g}  (client minus engine "
        "mean TTFT per load, ms, by streams: "
        + ", ".join(f"{n}: {statistics.fmean(v) * 1e3:.1f}" for n, v in sorted(by_streams.items()))
        + ")",
        f"transfer_per_token_s   {costs.transfer_per_token_s:.6g}  ({len(c.pulls)} P/D "
        f"hand-offs; decode TTFT median |error| {statistics.median(pull_errors):.1%})",
        f"router_s               {c.profile.router_s:.6g}  (median of {len(c.router)} lone "
        "requests through the router minus one straight to its engine)",
        f"cold_start_s           {costs.cold_start_s:.3f}  (median of "
        + ", ".join(f"{s:.2f}" for s in c.cold_starts_s)
        + ")",
        "",
        f"shape: {shape.kv_tokens} KV tokens in blocks of {shape.block_size}, "
        f"max_num_seqs {shape.max_num_seqs}, max_num_batched_tokens {max_batched}, "
        f"{shape.chars_per_token:.4f} chars/token, {shape.message_tokens} tokens a message",
    ]
    return "\n".join(lines)
