"""The router's chat rendering (``routing/tokenizer/template.py``) against transformers' own
``apply_chat_template(tokenize=False)`` in the pinned vLLM's environment (``vllm_judge.py``, op
``chat_render``: what vLLM's renderer calls), on the tokenizer files the tests write: the
reference engine's shipped template, ChatML, and a template using what transformers adds to
Jinja (``{% generation %}``, a ``tojson`` that leaves HTML alone, ``raise_exception``, loop
controls). Every switch the router follows: the generation prompt, continuing the final
message, neither."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleetpilot.engine.reference_launch import REFERENCE_TOKENIZER
from fleetpilot.routing.tokenizer.request import RequestTokenizer
from tests.contract.conftest import VllmJudge
from tests.routing.tokenizer_support import CHATML, trained

# transformers' additions to Jinja, each in use: a template rendered by plain Jinja fails on
# the generation tag and escapes tojson's HTML.
EXTENDED = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role ' + message['role']) }}{%- endif %}"
    "{%- if loop.index > 8 %}{%- break %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] }}{%- endgeneration %}"
    "{%- else %}{{- message['content'] }} {{ {'chars': message['content'] | length,"
    " 'meta': '<b>&</b>'} | tojson }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief & <polite>."},
    {"role": "user", "content": "Tell a story about 中文 and 🙂."},
    {"role": "assistant", "content": "Once upon"},
]
SWITCHES = [(True, False), (False, True), (False, False)]


def tokenizer_dir(folder: Path, template: str) -> Path:
    """A BPE tokenizer's files with ``template`` as its chat template (as a model repo ships
    them: tokenizer.json and tokenizer_config.json)."""
    tokenizer_json, config = trained("bytelevel")
    folder.mkdir()
    (folder / "tokenizer.json").write_text(tokenizer_json)
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


def ours(folder: Path, body: dict[str, Any]) -> str:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    return RequestTokenizer((folder / "tokenizer.json").read_text(), config).render_chat(body)


@pytest.mark.parametrize("template", ["shipped", "chatml", "extended"])
@pytest.mark.parametrize(("generation", "continue_final"), SWITCHES)
def test_the_router_renders_a_chat_as_transformers_does_for_vllm(
    vllm_judge: VllmJudge, tmp_path: Path, template: str, generation: bool, continue_final: bool
) -> None:
    folder = {
        "shipped": lambda: REFERENCE_TOKENIZER,
        "chatml": lambda: tokenizer_dir(tmp_path / "chatml", CHATML),
        "extended": lambda: tokenizer_dir(tmp_path / "extended", EXTENDED),
    }[template]()
    answer = vllm_judge.ask({"op": "chat_render", "tokenizer": str(folder), "messages": MESSAGES,
                             "add_generation_prompt": generation,
                             "continue_final_message": continue_final})  # fmt: skip
    assert answer["ok"], answer
    body = {"messages": MESSAGES, "add_generation_prompt": generation,
            "continue_final_message": continue_final}  # fmt: skip
    assert ours(Path(folder), body) == answer["text"]
