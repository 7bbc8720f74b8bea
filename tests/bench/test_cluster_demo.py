"""bench/cluster_demo.py reads `make cluster-demo`'s printout: the chat lines as the demo's own
``show`` prints them, the rest as its f-strings write them."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import cluster_demo

from fleetpilot.testing import cluster_demo as demo


def printout(capsys: pytest.CaptureFixture[str]) -> str:
    usage = SimpleNamespace(
        prompt_tokens=890, prompt_tokens_details=SimpleNamespace(cached_tokens=880)
    )
    plain = SimpleNamespace(prompt_tokens=12, prompt_tokens_details=None)
    demo.say("(Ready 8.4s after the apply)")
    demo.show("easy question (auto)", "tier=small; reason=easy", plain)
    demo.show("long document, again", "tier=small; prefix=events", usage)
    demo.say("  new engine 10.1.0.7 Ready 2.9s after the scale, serving after 3.1s (2 chats)")
    demo.say("processes left behind: []")
    demo.say("(the demo took 33s)")
    return capsys.readouterr().out


def test_a_round_is_read_from_the_demo_s_printout(capsys: pytest.CaptureFixture[str]) -> None:
    figures = cluster_demo.read_round(printout(capsys))
    assert figures["apply_to_ready_s"] == 8.4
    assert figures["chats"] == [
        {"label": "easy question (auto)", "route": "tier=small", "prompt_tokens": 12,
         "cached_tokens": 0},
        {"label": "long document, again", "route": "tier=small", "prompt_tokens": 890,
         "cached_tokens": 880},
    ]  # fmt: skip
    assert (figures["scale_ready_s"], figures["scale_serving_s"], figures["scale_chats"]) == (
        2.9, 3.1, 2,
    )  # fmt: skip
    assert (figures["demo_s"], figures["leftover_processes"]) == (33, 0)


def test_a_printout_missing_a_figure_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    text = printout(capsys).replace("Ready 8.4s after the apply", "Ready at last")
    with pytest.raises(ValueError, match="Ready line"):
        cluster_demo.read_round(text)
    assert (
        cluster_demo.read_round(
            printout(capsys).replace("left behind: []", "left behind: [41, 42]")
        )["leftover_processes"]
        == 2
    )
