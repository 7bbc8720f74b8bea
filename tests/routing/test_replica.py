"""What the router keeps of a replica between requests (``routing.replica``): where its traffic
went lately."""

from __future__ import annotations

from fleetpilot.routing.endpoints import Endpoint
from fleetpilot.routing.replica import RECENT_WINDOW_S, ReplicaState


def test_recent_sends_cover_this_window_and_the_one_before_then_age_out() -> None:
    state = ReplicaState(Endpoint("small", "unified", "10.0.0.1", 1), max_num_seqs=4)
    start = 100 * RECENT_WINDOW_S
    for i in range(3):
        state.note_send(start + i)
    assert state.recent_sends(start + 3) == 3
    state.note_send(start + RECENT_WINDOW_S)  # the next window: the three are the one before
    assert state.recent_sends(start + RECENT_WINDOW_S + 1) == 4
    assert state.recent_sends(start + 2 * RECENT_WINDOW_S) == 1  # the three aged out
    assert state.recent_sends(start + 10 * RECENT_WINDOW_S) == 0  # a long silence: none
    view = state.view(start + 10 * RECENT_WINDOW_S, stale_after_s=5.0, ejected=False)
    assert view.recent_sends == 0
    state.note_send(start + 10 * RECENT_WINDOW_S)
    view = state.view(start + 10 * RECENT_WINDOW_S, stale_after_s=5.0, ejected=False)
    assert view.recent_sends == 1  # the view is made anew when the traffic changes
