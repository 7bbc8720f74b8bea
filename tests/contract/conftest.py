"""The real vLLM as a session fixture: ``vllm_judge.py`` running in ``.venv-vllm``."""

from __future__ import annotations

import json
import os
import selectors
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleetpilot.engine.reference_launch import REFERENCE_TOKENIZER

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
JUDGE = Path(__file__).with_name("vllm_judge.py")
# Importing vLLM and building its serve parser takes ~10-30 s on a busy 2-core machine.
START_TIMEOUT_S = 300


class VllmJudge:
    """Questions to the pinned vLLM, answered by its own code (``vllm_judge.py``)."""

    def __init__(self, process: subprocess.Popen[str], version: str) -> None:
        self.process = process
        self.version = version

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM judge exited (code {self.process.poll()})")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def serve(self, argv: list[str]) -> dict[str, Any]:
        """vLLM's verdict on ``vllm serve <argv>``: ``ok`` and ``engine_args``, or ``error``."""
        return self.ask({"op": "serve", "argv": argv})


def _start() -> VllmJudge:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["CUDA_VISIBLE_DEVICES"] = ""
    process = subprocess.Popen(
        [str(VLLM_PYTHON), str(JUDGE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=sys.stderr,
        text=True,
        env=env,
        cwd=JUDGE.parent,
    )
    assert process.stdout is not None
    # A readline would block past any timeout; the first line is the ready signal.
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(START_TIMEOUT_S):
            process.kill()
            raise RuntimeError(f"the vLLM judge did not start within {START_TIMEOUT_S} s")
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"the vLLM judge failed to start (code {process.wait()})")
    ready = json.loads(line)
    return VllmJudge(process, ready["version"])


@pytest.fixture(scope="session")
def vllm_judge() -> Iterator[VllmJudge]:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"{VLLM_PYTHON.parent.parent} is absent: `make vllm` installs the real vLLM")
    judge = _start()
    yield judge
    assert judge.process.stdin is not None
    judge.process.stdin.close()
    try:
        judge.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        judge.process.kill()
        judge.process.wait()
    assert judge.process.stdout is not None
    judge.process.stdout.close()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local checkpoint folder vLLM configures an engine from, as ``vllm serve`` does (no
    weights are read): the reference engine's tiny Llama and its shipped tokenizer."""
    # The engine package imports torch: only the tests that need a checkpoint pay for it.
    from fleetpilot.engine.reference.checkpoint import save_checkpoint
    from fleetpilot.engine.reference.model import LlamaModel
    from fleetpilot.engine.reference.settings import MODEL_PRESETS

    checkpoint = tmp_path_factory.mktemp("tiny-llama")
    save_checkpoint(LlamaModel(MODEL_PRESETS["tiny"]), checkpoint)
    for file in REFERENCE_TOKENIZER.glob("*.json"):
        shutil.copy(file, checkpoint / file.name)
    return checkpoint
