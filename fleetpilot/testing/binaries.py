"""Where the test control plane's four binaries are, and building them when they are not there.

They are built from Go modules by `e2e/controlplane/build.sh` (which says why they are built
rather than downloaded) into the checkout's `.cache/controlplane/bin`, or wherever
$FLEETPILOT_CONTROLPLANE_BIN points, e.g. for an install without a checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from fleetpilot.testing.errors import ControlPlaneError

#: Start order; stop runs in reverse so no component outlives what it depends on.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")


def repo_root() -> Path | None:
    """The source checkout this module runs from, or None when installed without one."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "e2e" / "controlplane" / "build.sh").is_file() else None


def default_bin_dir() -> Path:
    """Where build.sh puts the binaries: $FLEETPILOT_CONTROLPLANE_BIN, else the checkout's cache."""
    env = os.environ.get("FLEETPILOT_CONTROLPLANE_BIN")
    if env:
        return Path(env)
    root = repo_root()
    if root is None:
        raise ControlPlaneError(
            "no fleetpilot checkout found next to this module; set FLEETPILOT_CONTROLPLANE_BIN "
            "to a folder holding etcd, kube-apiserver, kube-controller-manager, kube-scheduler"
        )
    return root / ".cache" / "controlplane" / "bin"


def ensure_binaries(bin_dir: Path | None = None, *, build: bool = True) -> Path:
    """Return a folder holding all four binaries, building them first when `build` is set.

    build.sh is a no-op when the binaries are up to date, so calling this every time is cheap;
    the first build on a fresh machine takes 10-25 minutes on 2 cores.
    """
    target = bin_dir if bin_dir is not None else default_bin_dir()
    root = repo_root()
    if build and root is not None:
        script = root / "e2e" / "controlplane" / "build.sh"
        env = dict(os.environ, FLEETPILOT_CONTROLPLANE_BIN=str(target))
        # stdout=2: the CLI prints only the kubeconfig path on stdout.
        result = subprocess.run(["bash", str(script)], env=env, stdout=2, check=False)
        if result.returncode != 0:
            raise ControlPlaneError(
                f"{script} failed (exit {result.returncode}); its output above names the step"
            )
    missing = [name for name in COMPONENTS if not os.access(target / name, os.X_OK)]
    if missing:
        raise ControlPlaneError(
            f"missing control-plane binaries in {target}: {', '.join(missing)}; "
            "run e2e/controlplane/build.sh"
        )
    return target


def go_tool_skip_reason(what: str) -> str | None:
    """Why a Go program of the e2e harness cannot run here (None: it can): it is built with
    Go, from a fleetpilot checkout; ``what`` names it."""
    if shutil.which("go") is None:
        return f"{what} is built with Go, which is not on PATH"
    if repo_root() is None:
        return f"{what} is built from a fleetpilot checkout"
    return None


def go_tool(name: str, what: str, *, build: bool = True) -> Path:
    """A Go program of the e2e harness (``e2e/<name>``), built first by its build.sh (a no-op
    when up to date) into ``.cache/<name>/bin/<name>``; ``what`` names it in errors."""
    root = repo_root()
    if root is None:
        raise ControlPlaneError(f"{what} is built from a fleetpilot checkout")
    if build:
        script = root / "e2e" / name / "build.sh"
        result = subprocess.run(["bash", str(script)], stdout=2, check=False)
        if result.returncode != 0:
            raise ControlPlaneError(f"{script} failed (exit {result.returncode})")
    binary = root / ".cache" / name / "bin" / name
    if not os.access(binary, os.X_OK):
        raise ControlPlaneError(f"no {what} at {binary}; run e2e/{name}/build.sh")
    return binary
