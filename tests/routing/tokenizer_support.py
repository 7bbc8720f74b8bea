"""What the tokenizer tests share (issue 14): BPE tokenizers trained here with their chat
templates, the reference engine's shipped files, request bodies, and the whole-encode oracle
the prefix cache is checked against."""

from __future__ import annotations

import json
import random
from functools import cache
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from fleetpilot.engine.reference.hf_tokenizer import SHIPPED
from fleetpilot.engine.reference.tokenizer import ByteTokenizer
from fleetpilot.routing.tokenizer.request import RequestTokenizer

SHIPPED_CONFIG = json.loads((SHIPPED / "tokenizer_config.json").read_text())
BYTES = ByteTokenizer()
EXAMPLES = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ChatML with a loop over content parts (vLLM gives such a template content as parts).
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}{{- part['text'] }}{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama-2 style: BOS from the template, string content, SentencePiece-like pre-tokenizer.
LLAMA2 = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'system' %}{{ '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>' }}"
    "{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}{% endif %}{% endfor %}"
)
SPECIALS = {
    "bytelevel": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "metaspace": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
}
ALPHABET = "abcdefghij klmnop\n\tXYZ0123.,!?<>|/[]é中🙂"


def corpus(seed: int, lines: int) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(1, 9))) for _ in range(3000)]
    ends = [".", "!", "\n", "?"]
    return [" ".join(rng.choices(words, k=60)) + rng.choice(ends) for _ in range(lines)]


@cache
def trained(style: str, vocab_size: int = 2000) -> tuple[str, dict[str, Any]]:
    """A BPE tokenizer trained on generated text, with a chat template: ``bytelevel`` (GPT-2/Qwen
    style, ChatML) or ``metaspace`` (SentencePiece/Llama-2 style: NFKC, prepend-first, BOS from
    the post-processor and the template)."""
    tok = Tokenizer(models.BPE(unk_token="<unk>") if style == "metaspace" else models.BPE())
    if style == "bytelevel":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        config: dict[str, Any] = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
        config["chat_template"] = CHATML
    else:
        tok.normalizer = normalizers.NFKC()
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace()
        alphabet = list(ALPHABET)
        config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
        config["chat_template"] = LLAMA2
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS[style], initial_alphabet=alphabet
    )
    tok.train_from_iterator(corpus(7, 1500), trainer)
    if style == "metaspace":
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", bos)]
        )
    return tok.to_str(), config


def make(style: str, **options: Any) -> RequestTokenizer:
    """``shipped`` (the reference engine's files as a router loads them) or a trained style."""
    if style == "shipped":
        return RequestTokenizer.from_dir(SHIPPED, **options)
    tokenizer_json, config = trained(style)
    return RequestTokenizer(tokenizer_json, config, source=style, **options)


def whole(t: RequestTokenizer, kind: str, payload: dict[str, Any]) -> list[int]:
    """The prompt ids by one ``tokenizers`` call on the request's whole text: no cache, no cut."""
    if kind == "chat":
        text, specials = t.render_chat(payload), payload.get("add_special_tokens", False)
    else:
        text, specials = payload["prompt"], payload.get("add_special_tokens", True)
    return t.tokenizer.encode(text, add_special_tokens=specials).ids


def text_with(style: str) -> st.SearchStrategy[str]:
    """Text that mixes ordinary characters with the tokenizer's special tokens' names."""
    names = SPECIALS.get(style, ["<|bos|>", "<|eos|>"])
    piece = st.one_of(st.text(ALPHABET, max_size=12), st.sampled_from(names))
    return st.lists(piece, max_size=10).map("".join)


def chat(*contents: str, system: str | None = None) -> dict[str, Any]:
    """A chat body whose messages alternate user/assistant, starting and ending with user."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    roles = ["user", "assistant"]
    messages += [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    return {"messages": messages}
