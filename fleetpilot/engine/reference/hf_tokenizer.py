"""The reference engine's byte tokenizer and chat template in Hugging Face's file formats.

A router that matches prompts against what the engines cache (their KV events carry token ids)
must tokenize a request exactly as the engine will: with the model's own ``tokenizer.json``
(the ``tokenizers`` library) and the chat template of its ``tokenizer_config.json``, rendered
as vLLM renders it (Jinja in a sandbox, ``trim_blocks`` and ``lstrip_blocks``). For real models
those files come with the checkpoint; this module writes them for the reference engine's
:class:`~fleetpilot.engine.reference.tokenizer.ByteTokenizer`, so the router's tokenizing path
is exercised on a CPU exactly as it runs against vLLM. ``tokenizer/`` beside this module holds
the files as shipped; a test keeps them equal to what :func:`build_tokenizer` makes and to
``ByteTokenizer`` itself.

How the byte tokenizer becomes a ``tokenizers`` pipeline: the ByteLevel pre-tokenizer maps each
UTF-8 byte to one printable character (GPT-2's table) without splitting on spaces; a BPE model
with no merges maps each such character to the byte's value, 0..255; a template adds BOS (256).
The BOS/EOS strings are ordinary vocabulary entries, not "added tokens": a prompt that spells
``<|bos|>`` is encoded byte by byte, as ``ByteTokenizer`` does, never as the special token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from fleetpilot.engine.reference.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, NUM_BYTE_TOKENS

BOS = "<|bos|>"
EOS = "<|eos|>"
SHIPPED = Path(__file__).resolve().parent / "tokenizer"

# ByteTokenizer.apply_chat_template as Jinja: "<|role|>\ncontent\n" per message, then the
# assistant's header when a generation prompt is asked for. It starts with the BOS token, as
# Llama-style templates do: vLLM encodes a rendered chat without adding special tokens, so the
# template carries the BOS the engine puts before every chat prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def _byte_characters() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(NUM_BYTE_TOKENS):
        if b not in table:
            table[b] = chr(NUM_BYTE_TOKENS + shifted)
            shifted += 1
    return table


def build_tokenizer() -> Tokenizer:
    """A ``tokenizers.Tokenizer`` that encodes exactly as ``ByteTokenizer.encode``."""
    vocab = {char: byte for byte, char in _byte_characters().items()}
    vocab[BOS] = BOS_TOKEN_ID
    vocab[EOS] = EOS_TOKEN_ID
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, BOS_TOKEN_ID)]
    )
    return tokenizer


def tokenizer_config() -> dict[str, Any]:
    """``tokenizer_config.json``: the chat template and the special tokens' names."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer_files(directory: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(build_tokenizer().to_str(pretty=True) + "\n")
    config = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False)
    (directory / "tokenizer_config.json").write_text(config + "\n")


if __name__ == "__main__":
    # Regenerate the shipped files: python -m fleetpilot.engine.reference.hf_tokenizer
    write_tokenizer_files(SHIPPED)
