"""The bench's progress line: a bar and the time left when the run is bounded."""

from __future__ import annotations

from fleetpilot.loadgen.cli import progress_line
from fleetpilot.loadgen.runner import Progress


def test_a_timed_run_shows_its_share_done_and_the_seconds_left() -> None:
    line = progress_line(Progress(sent=50, done=45), 15.0, 60.0, None)
    assert line.startswith("[#####...............]  25%  ETA 45 s")
    assert "done 45" in line


def test_a_counted_run_estimates_from_its_send_rate_and_the_nearer_bound_wins() -> None:
    # 100 of 400 sent in 10 s: 30 s to go by count; a 20 s duration ends it sooner.
    assert "ETA 30 s" in progress_line(Progress(sent=100, done=90), 10.0, None, 400)
    assert "50%  ETA 10 s" in progress_line(Progress(sent=100, done=90), 10.0, 20.0, 400)


def test_an_unbounded_run_has_no_bar() -> None:
    line = progress_line(Progress(sent=3, done=3), 2.0, None, None)
    assert not line.startswith("[")
    assert "1.5 req/s" in line
