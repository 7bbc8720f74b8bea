"""`make cluster-demo` keeps working: the whole loop on its own control plane and process
nodes, shown as a user sees it, and nothing left running after."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from fleetpilot.testing.processnode import network_namespaces, skip_reason

pytestmark = pytest.mark.cluster


def test_cluster_demo_shows_tiers_prefix_hits_and_a_served_scale_up() -> None:
    """The demo exits 0; its output shows the service Ready through kubectl, chats served by
    both tiers, the repeated document served from the prefix cache, the new engine of the
    scale-up serving, and no process or pod network left behind."""
    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    if shutil.which("kubectl") is None:
        pytest.skip("the demo runs kubectl, which is not on PATH")
    result = subprocess.run(
        [sys.executable, "-m", "fleetpilot.testing.cluster_demo"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "inferenceservice.fleetpilot.dev/cpu condition met" in out
    assert re.search(r"inferenceservice\.fleetpilot\.dev/cpu\s+True\s+2/2", out), out
    assert re.search(r"easy question \(auto\)\s+tier=small", out), out
    assert re.search(r"asks for large-model\s+tier=large", out), out
    (again,) = re.findall(r"long document, again .* served from prefix cache (\d+)", out)
    assert int(again) > 0, out
    assert re.search(r"new engine \S+ Ready [\d.]+s after the scale, serving after", out), out
    # Four pods at the end: the router, the large engine and both small ones, all Running.
    final = out[out.rindex("get inferenceservices,pods") :]
    assert len(re.findall(r"^pod/\S+\s+1/1\s+Running", final, re.MULTILINE)) == 4, final
    assert "processes left behind: []" in out
    assert network_namespaces() == set()
