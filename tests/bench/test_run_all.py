"""bench/run_all.py's catalogue against the docs' tables and the scripts' own argument parsers.

Nothing here runs a benchmark: each script's arguments are checked by running its module with
``ArgumentParser.parse_args`` replaced by one that parses and then stops the script.
"""

from __future__ import annotations

import argparse
import json
import runpy
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import run_all  # noqa: E402
import tables  # noqa: E402


def marked_results() -> set[str]:
    names = set()
    for page in tables.pages():
        for block in tables.BLOCK.finditer(page.read_text()):
            for source in block["source"].split(","):
                names.add(Path(source).name.removesuffix(".json"))
    return names


def test_every_table_s_results_file_has_exactly_one_entry() -> None:
    counts = Counter(entry.results for entry in run_all.CATALOGUE)
    assert [name for name, n in counts.items() if n > 1] == []
    missing = sorted(marked_results() - set(counts))
    assert missing == [], f"results files a docs table reads with no catalogue entry: {missing}"


def test_every_entry_s_script_exists() -> None:
    for entry in run_all.CATALOGUE:
        assert (BENCH / entry.script).is_file(), entry
        assert entry.cwd in (".", "bench"), entry


class ParsedError(Exception):
    pass


def check_args(
    script: Path, args: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> argparse.Namespace:
    """The namespace ``script``'s parser makes of ``args`` (argparse's SystemExit if it
    refuses them)."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *a: Any, **kw: Any) -> Any:
        raise ParsedError(original(self, *a, **kw))

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        patch.setattr(sys, "argv", [str(script), *args])
        patch.syspath_prepend(str(BENCH))
        with pytest.raises(ParsedError) as parsed:
            runpy.run_path(str(script), run_name="__main__")
    namespace = parsed.value.args[0]
    assert isinstance(namespace, argparse.Namespace)
    return namespace


@pytest.mark.parametrize("entry", run_all.CATALOGUE, ids=lambda e: e.results)
def test_every_entry_s_arguments_are_accepted_by_its_script(
    entry: run_all.Entry, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = BENCH / entry.script
    if "argparse" not in script.read_text():
        # No parser: the script takes no arguments, so neither may the entry.
        assert entry.full == (), entry
        assert entry.quick is None, entry
        return
    for args in {entry.full, entry.args(quick=True)}:
        try:
            namespace = check_args(script, args, monkeypatch)
        except SystemExit as exit:  # argparse's error
            pytest.fail(f"bench/{entry.script} refuses {args}: exit {exit.code}")
        # A script that writes its results file only when asked must be asked: without it
        # the run prints its numbers and leaves the file (and the docs) as they were.
        assert getattr(namespace, "save", True), f"{entry.results}: {args} lack --save"


def run_all_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH / "run_all.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_dry_run_prints_every_command_and_runs_nothing() -> None:
    before = {p: p.stat().st_mtime_ns for p in (BENCH / "results").iterdir()}
    done = run_all_cli("--dry-run", "--quick")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == len(run_all.CATALOGUE) + 1
    for entry, line in zip(run_all.CATALOGUE, lines, strict=False):
        assert entry.script in line
        assert line.startswith("$ ")
    assert lines[-1].endswith("bench/tables.py")
    assert "--quick" in next(line for line in lines if "kv_offload.py" in line)
    assert {p: p.stat().st_mtime_ns for p in (BENCH / "results").iterdir()} == before


def test_only_picks_entries_and_an_unknown_name_is_an_error_naming_it() -> None:
    done = run_all_cli("--dry-run", "--only", "bench/results/whole_loop.json", "kv_offload")
    assert done.returncode == 0, done.stderr
    assert [line.split()[5] for line in done.stdout.splitlines()[:-1]] == [
        "bench/whole_loop.py",
        "kv_offload.py",
    ]
    assert "cd bench &&" in done.stdout.splitlines()[1]
    done = run_all_cli("--dry-run", "--only", "whole_loop", "no_such_benchmark")
    assert done.returncode != 0
    assert "no_such_benchmark" in done.stderr
    assert done.stdout == ""


def _option(args: tuple[str, ...], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_free_text_names_are_the_scripts_own() -> None:
    """Scenario keys and arm names that argparse takes as plain strings: a misspelt one would
    run nothing for it (router_kv_events.py, kv_offload.py)."""
    import kv_offload
    import router_kv_events

    scenarios = {s.key: set(s.arms) for s in router_kv_events.scenarios(False, 11)}
    for entry in run_all.CATALOGUE:
        command = list(entry.full)
        if entry.script == "compare_trees.py":
            command = command[command.index("--") + 1 :]
            script = Path(command.pop(0)).name
        else:
            script = entry.script
        args = tuple(command)
        if script == "router_kv_events.py":
            keys = (_option(args, "--scenarios") or ",".join(scenarios)).split(",")
            assert set(keys) <= set(scenarios), entry
            arms = _option(args, "--arms")
            if arms:
                offered = set().union(*(scenarios[k] for k in keys))
                assert set(arms.split(",")) <= offered, entry
        if script == "kv_offload.py" and _option(args, "--arms"):
            assert set(str(_option(args, "--arms")).split(";")) <= set(kv_offload.ARMS), entry


def test_shorter_replaces_values_in_place_and_adds_what_is_missing() -> None:
    full = ("--rounds", "3", "--arms", "a", "b", "--save")
    assert run_all.shorter(full, rounds="1", duration="20", quick=None) == (
        "--duration", "20", "--rounds", "1", "--arms", "a", "b", "--save", "--quick",
    )  # fmt: skip
    assert full == ("--rounds", "3", "--arms", "a", "b", "--save")  # the full list untouched
    assert run_all.shorter(full, prefix_duration="1m")[:2] == ("--prefix-duration", "1m")


def test_a_run_records_its_mode_and_command_in_the_results_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run_all, "RESULTS", tmp_path)
    entry = run_all.Entry("x", "x.py", ("--rounds", "3"), ("--rounds", "1"))
    (tmp_path / "x.json").write_text('{"rows": [1]}')
    run_all.stamp(entry, quick=True)
    assert json.loads((tmp_path / "x.json").read_text()) == {
        "rows": [1],
        "run_all": {"mode": "quick", "command": "python bench/x.py --rounds 1"},
    }
    run_all.stamp(run_all.Entry("x", "x.py", (), None), quick=True)  # no shorter way: full
    assert json.loads((tmp_path / "x.json").read_text())["run_all"]["mode"] == "full"
    run_all.stamp(run_all.Entry("missing", "m.py", (), None), quick=False)  # nothing written
    assert not (tmp_path / "missing.json").exists()
