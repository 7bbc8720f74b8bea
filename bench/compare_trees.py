"""One benchmark, run against this checkout and an earlier commit in one run: the code before
a change and after it, rounds alternating so both see the same machine.

A refactor that should change nothing (issue 43) is judged by the benchmarks it must not move:
this checks out ``--base`` in a temporary git worktree, then runs the benchmark script from each
tree in turn (its own code on ``PYTHONPATH``, the same interpreter), ``--rounds`` times, reads
the results file each run wrote in its own tree, and prints every number whose path matches
``--keys`` for both trees: per round, and the median and range over the rounds.

Run: .venv/bin/python bench/compare_trees.py --base REV --results NAME [--rounds N]
     [--keys REGEX] [--save NAME] -- bench/SCRIPT.py [ARGS...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from router_support import ROOT, commit, machine, save


def leaves(data: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Every number in a results file, by path; a list element is named by its "scenario" or
    "arm" when it has one (so rows line up across runs), else by its index."""
    if isinstance(data, bool):
        return
    if isinstance(data, int | float):
        yield path, float(data)
    elif isinstance(data, dict):
        for key, value in data.items():
            yield from leaves(value, f"{path}.{key}" if path else str(key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            label: object = i
            if isinstance(value, dict):
                label = value.get("scenario", value.get("arm", i))
            yield from leaves(value, f"{path}[{label}]")


def run_in(tree: Path, script: str, args: list[str], results: str) -> dict[str, float]:
    """The benchmark run from ``tree``: the numbers of the results file it wrote there."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [sys.executable, str(tree / script), *args]
    print(f"$ (cd {tree} && {' '.join(argv)})", flush=True)
    subprocess.run(argv, cwd=tree, env=env, check=True)
    data = json.loads((tree / "bench" / "results" / f"{results}.json").read_text())
    return dict(leaves(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the earlier commit")
    parser.add_argument("--results", required=True, help="the results file the script writes")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--keys", default=".", help="regex over the numbers' paths")
    parser.add_argument("--save", help="write the comparison as bench/results/NAME.json")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- bench/SCRIPT.py ARGS")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("name the benchmark after --")
    keys = re.compile(args.keys)
    base = subprocess.run(
        ["git", "rev-parse", args.base], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    runs: dict[str, list[dict[str, float]]] = {"base": [], "head": []}
    # The benchmark writes its results file in this checkout too: put back what was there, so
    # a comparison never passes for the benchmark's own recorded run.
    own = ROOT / "bench" / "results" / f"{args.results}.json"
    kept = own.read_bytes() if own.exists() else None
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), base], cwd=ROOT,
                       check=True, capture_output=True)  # fmt: skip
        try:
            for round_ in range(args.rounds):
                # Alternate which goes first, so neither always runs on the warmer machine.
                order = [("base", tree), ("head", ROOT)]
                for name, where in order if round_ % 2 == 0 else order[::-1]:
                    runs[name].append(run_in(where, command[0], command[1:], args.results))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           check=False, capture_output=True)  # fmt: skip
            if kept is None:
                own.unlink(missing_ok=True)
            else:
                own.write_bytes(kept)
    paths = [p for p in runs["head"][0] if keys.search(p) and all(p in r for r in runs["base"])]
    table: dict[str, dict[str, Any]] = {}
    print(f"\n{'number':70} {'base median [range]':>26} {'head median [range]':>26}")
    for path in paths:
        cells = []
        for name in ("base", "head"):
            values = [r[path] for r in runs[name] if path in r]
            median = statistics.median(values)
            table.setdefault(path, {})[name] = {"rounds": values, "median": median}
            cells.append(f"{median:.4g} [{min(values):.4g}-{max(values):.4g}]")
        print(f"{path[:70]:70} {cells[0]:>26} {cells[1]:>26}")
    if args.save:
        written = save(
            args.save,
            {
                "benchmark": "compare_trees",
                "command": command,
                "base": base,
                "head": commit(),
                "rounds": args.rounds,
                "machine": machine(),
                "numbers": table,
            },
        )
        print(f"wrote {written}")


if __name__ == "__main__":
    main()
