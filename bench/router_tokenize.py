"""What tokenizing a request adds to a routing decision (issue 14, hot-path tokenization): the
router's ``RequestTokenizer.keys`` (render the chat, tokenize, chain KV-index keys) for a
~2,000-token conversation, one request at a time.

Tokenizers: ``reference`` (the reference engine's shipped byte tokenizer: a token a byte) and
``bpe32k`` (a byte-level BPE with a ~32k vocabulary and ChatML special tokens, trained here on
generated text with Zipf-distributed words, so merges are as long as in real vocabularies).

Scenarios, each over distinct conversations (system prompt, then user/assistant turns, ending
with a user message, ~2,000 tokens in all):

- ``cached prefix``: the conversation's previous request (everything but the last reply and the
  new question) was seen; the request tokenizes its new tail (~230 tokens: the reply it has not
  seen and the question) and chains its keys from the cached ones. The issue's goal: p50 <=
  0.5 ms.
- ``cached prefix, reply remembered``: the same, with the previous reply handed to
  ``remember_reply`` as the router sees it on its way back: only the question (~80 tokens) and
  the template's framing are new.
- ``cold``: a conversation never seen: the whole prompt is tokenized (and its prefixes stored).
- ``baseline``: the uncached whole-prompt path without the module's cache: render, one
  ``tokenizers`` encode of the whole text, ``chain_keys`` of every block.
- ``render only``: the Jinja render alone, the part no cache saves.
- ``cold at the cap``: one unseen user message of ``DEFAULT_MAX_CHARS`` characters: the most
  one request can cost.

The router renders the chat with transformers' own ``render_jinja_template`` (issue 43 part 3,
decided on this benchmark's comparison: ``bench/results/router_tokenize_transformers.json``,
measured when the router still rendered with its own copy of transformers' Jinja setup). The
``cached prefix`` scenarios also run with the chat rendered by a transformers
``AutoTokenizer``'s ``apply_chat_template(tokenize=False)``, vLLM's whole call, in front of the
same prefix cache, and ``render only`` with it alone; its keys are checked equal to the
router's on every measured request. (An interpreter without transformers leaves them out.)

Run: PYTHONPATH=. .venv/bin/python bench/router_tokenize.py [--conversations 300]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import random
import tempfile
import time
from collections.abc import Callable, Mapping
from functools import partial
from itertools import accumulate
from pathlib import Path
from typing import Any

from router_support import ROOT, commit, machine, percentile, save
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from fleetpilot.routing.policies.kv_index import MAX_MATCH_BLOCKS, chain_keys
from fleetpilot.routing.tokenizer.messages import conversation, flag
from fleetpilot.routing.tokenizer.request import DEFAULT_MAX_CHARS, RequestTokenizer
from fleetpilot.routing.tokenizer.template import Rendered, message_spans

SHIPPED = ROOT / "fleetpilot" / "engine" / "reference" / "tokenizer"
BLOCK_SIZE = 16
HF_CACHED = "cached prefix"
HF_REMEMBERED = "cached prefix, reply remembered"
TARGET_TOKENS = 2000
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class Text:
    """Generated English-like text: ~60k word types from syllables, drawn with Zipf weights."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        vowels = ["a", "e", "i", "o", "u", "ai", "ou"]
        syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in vowels]
        seen: set[str] = set()
        while len(seen) < 60_000:
            seen.add("".join(self.rng.choices(syllables, k=self.rng.choice([1, 1, 2, 2, 2, 3, 4]))))
        # Frequent words short, as in English (~4.5 characters a token with a 32k vocabulary).
        self.words = sorted(seen, key=lambda w: (len(w) + self.rng.random() * 6, w))
        self.cum_weights = list(accumulate(1 / (i + 1) for i in range(len(self.words))))

    def sentence(self, n: int) -> str:
        words = self.rng.choices(self.words, cum_weights=self.cum_weights, k=n)
        words[0] = words[0].capitalize()
        return " ".join(words) + self.rng.choice([".", ".", "?", "!", ":\n"])

    def paragraph(self, words: int) -> str:
        out: list[str] = []
        while words > 0:
            n = min(words, self.rng.randint(5, 20))
            out.append(self.sentence(n))
            words -= n
        return " ".join(out)


def _bpe(text: Text, vocab_size: int) -> tuple[Tokenizer, dict[str, Any]]:
    """A byte-level BPE of ``vocab_size`` trained on ``text`` with ChatML specials, and its
    tokenizer config (the chat template)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((text.paragraph(200) for _ in range(8_000)), trainer)
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}
    return tok, config


def train_bpe(text: Text, vocab_size: int = 32_000) -> RequestTokenizer:
    tok, config = _bpe(text, vocab_size)
    return RequestTokenizer(tok.to_str(), config, source="bpe32k")


def train_bpe_files(text: Text, folder: Path, vocab_size: int = 32_000) -> Path:
    """The same BPE as a model directory a router loads (``tokenizer.json`` and
    ``tokenizer_config.json``): ``folder``."""
    tok, config = _bpe(text, vocab_size)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


class TransformersRendered(RequestTokenizer):
    """The router's tokenizer with its chat rendered by transformers' ``apply_chat_template``
    (``tokenize=False``, the tokenizer's own template, as vLLM calls it) instead of
    ``template.ChatTemplate``, the messages normalized as vLLM does before that call, and the
    same prefix cache behind. Only what this benchmark sends: messages, add_generation_prompt."""

    def __init__(self, *args: Any, hf: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self._hf = hf

    def _render(self, payload: Mapping[str, Any]) -> Rendered:
        assert self._chat is not None
        chat = conversation(payload["messages"], self._chat.content_as_parts)
        generation = flag(payload, "add_generation_prompt", True)
        text: str = self._hf.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=generation
        )
        spans, final = message_spans(text, chat)
        return Rendered(text, spans, final, specials=False)


def transformers_rendered(path: Path) -> Callable[[], RequestTokenizer] | None:
    """A maker of :class:`TransformersRendered` for the tokenizer files in ``path``; None when
    this interpreter has no transformers."""
    try:
        auto = importlib.import_module("transformers").AutoTokenizer
    except ImportError:
        return None
    hf = auto.from_pretrained(str(path))
    return lambda: TransformersRendered.from_dir(path, hf=hf)


def conversation_pair(
    text: Text, t: RequestTokenizer, words_per_token: float
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the previous request, this one): a ~TARGET_TOKENS conversation ending with a question
    (~80 tokens) after a reply (~150 tokens), and the request before that reply."""

    def words(tokens: int) -> int:
        return max(3, round(tokens * words_per_token))

    messages = [{"role": "system", "content": text.paragraph(words(500))}]
    while True:
        messages.append({"role": "user", "content": text.paragraph(words(80))})
        tokens = len(t.token_ids("chat", {"messages": messages}))
        if tokens >= TARGET_TOKENS - 60:
            break
        messages.append({"role": "assistant", "content": text.paragraph(words(150))})
    return {"messages": messages[:-2]}, {"messages": messages}


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1e6


def baseline(t: RequestTokenizer, body: dict[str, Any]) -> list[bytes]:
    ids = t.tokenizer.encode(t.render_chat(body), add_special_tokens=False).ids
    return chain_keys(ids, BLOCK_SIZE, max_blocks=MAX_MATCH_BLOCKS)


def run(
    name: str,
    make: Callable[[], RequestTokenizer],
    text: Text,
    n: int,
    make_hf: Callable[[], RequestTokenizer] | None = None,
) -> list[dict[str, Any]]:
    probe = make()
    sample = text.paragraph(2000)
    words_per_token = 2000 / len(probe.token_ids("completions", {"prompt": sample}))
    pairs = [conversation_pair(text, probe, words_per_token) for _ in range(2 * n + 20)]
    sizes = [len(probe.token_ids("chat", cur)) for _, cur in pairs]
    rows: list[dict[str, Any]] = []

    def row(scenario: str, times: list[float], chars: list[int], tokens: int | None = None) -> None:
        rows.append(
            {
                "tokenizer": name,
                "scenario": scenario,
                "requests": len(times),
                "p50_ms": round(percentile(times, 0.5), 4),
                "p95_ms": round(percentile(times, 0.95), 4),
                "mean_encoded_chars": round(sum(chars) / len(chars)) if chars else None,
                "prompt_tokens_p50": int(percentile(sizes, 0.5)) if tokens is None else tokens,
            }
        )

    warm, measured, cold_pairs = pairs[:20], pairs[20 : 20 + n], pairs[20 + n :]
    # One tokenizer per scenario, the scenarios taking turns conversation by conversation, so
    # that the machine's drift (this VM's speed varies by 2x over minutes) falls on all alike.
    cached, remembered, cold = make(), make(), make()
    hf = [make_hf(), make_hf()] if make_hf is not None else []
    for prev, cur in warm:
        for t in (cached, remembered, cold, *hf):
            t.keys("chat", prev, BLOCK_SIZE)
            t.keys("chat", cur, BLOCK_SIZE)
        baseline(cold, cur)
    gc.collect()
    scenarios = ["cached prefix", "cached prefix, reply remembered", "cold"]
    scenarios += ["baseline (whole prompt, no cache)", "render only"]
    if hf:
        scenarios += [f"{s}, transformers render" for s in (HF_CACHED, HF_REMEMBERED)]
        scenarios += ["render only, transformers"]
    times: dict[str, list[float]] = {s: [] for s in scenarios}
    chars: dict[str, list[int]] = {s: [] for s in scenarios}

    def measure(scenario: str, t: RequestTokenizer, body: dict[str, Any]) -> None:
        before = t.stats.encoded_chars
        times[scenario].append(timed(partial(t.keys, "chat", body, BLOCK_SIZE)))
        chars[scenario].append(t.stats.encoded_chars - before)

    for (prev, cur), (_, unseen) in zip(measured, cold_pairs, strict=True):
        cached.keys("chat", prev, BLOCK_SIZE)
        measure("cached prefix", cached, cur)
        remembered.keys("chat", prev, BLOCK_SIZE)
        remembered.remember_reply(prev, cur["messages"][-2]["content"])
        measure("cached prefix, reply remembered", remembered, cur)
        measure("cold", cold, unseen)
        times["baseline (whole prompt, no cache)"].append(timed(partial(baseline, cold, cur)))
        chars["baseline (whole prompt, no cache)"].append(len(cold.render_chat(cur)))
        times["render only"].append(timed(partial(cold.render_chat, cur)))
        if hf:
            hf_cached, hf_remembered = hf
            hf_cached.keys("chat", prev, BLOCK_SIZE)
            measure(f"{HF_CACHED}, transformers render", hf_cached, cur)
            hf_remembered.keys("chat", prev, BLOCK_SIZE)
            hf_remembered.remember_reply(prev, cur["messages"][-2]["content"])
            measure(f"{HF_REMEMBERED}, transformers render", hf_remembered, cur)
            times["render only, transformers"].append(timed(partial(hf_cached.render_chat, cur)))
            # The same ids as ours, or the comparison is void.
            assert hf_cached.keys("chat", cur, BLOCK_SIZE) == cached.keys("chat", cur, BLOCK_SIZE)
    for scenario in scenarios:
        row(scenario, times[scenario], chars[scenario])

    t = make()
    huge = []
    for _ in range(8):
        content = text.paragraph(DEFAULT_MAX_CHARS // 4)[: DEFAULT_MAX_CHARS - 100]
        huge.append({"messages": [{"role": "user", "content": content}]})
    before = t.stats.encoded_chars
    at_cap = [timed(partial(t.keys, "chat", body, BLOCK_SIZE)) for body in huge]
    encoded = [(t.stats.encoded_chars - before) // len(huge)]
    row("cold at the cap", at_cap, encoded, len(probe.token_ids("chat", huge[0])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=300)
    args = parser.parse_args()
    text = Text(11)
    start = time.perf_counter()
    bpe = train_bpe(text)
    train_s = time.perf_counter() - start
    tokenizers: dict[str, Callable[[], RequestTokenizer]] = {
        "reference": lambda: RequestTokenizer.from_dir(Path(SHIPPED)),
        "bpe32k": lambda: RequestTokenizer(
            bpe.tokenizer.to_str(), {"eos_token": "<|im_end|>", "chat_template": CHATML}
        ),
    }
    with tempfile.TemporaryDirectory() as bpe_dir:
        # The same files for transformers to load (the class it falls back to without one).
        (Path(bpe_dir) / "tokenizer.json").write_text(bpe.tokenizer.to_str())
        config = {"eos_token": "<|im_end|>", "chat_template": CHATML}
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        (Path(bpe_dir) / "tokenizer_config.json").write_text(json.dumps(config))
        hf_makers = {
            "reference": transformers_rendered(Path(SHIPPED)),
            "bpe32k": transformers_rendered(Path(bpe_dir)),
        }
        rows: list[dict[str, Any]] = []
        for name, make in tokenizers.items():
            rows += run(name, make, text, args.conversations, hf_makers[name])
    if hf_makers["reference"] is None:
        print("transformers is not importable here: its rendering scenarios are left out")
    header = ("tokenizer", "scenario", "p50 ms", "p95 ms", "chars", "tokens")
    print("{:<10} {:<52} {:>8} {:>8} {:>7} {:>7}".format(*header))
    for r in rows:
        chars = "" if r["mean_encoded_chars"] is None else str(r["mean_encoded_chars"])
        print(
            f"{r['tokenizer']:<10} {r['scenario']:<52} {r['p50_ms']:>8.3f} {r['p95_ms']:>8.3f}"
            f" {chars:>7} {r['prompt_tokens_p50']:>7}"
        )
    for r in rows:
        if r["scenario"].startswith("cached prefix"):
            met = "met" if r["p50_ms"] <= 0.5 else "not met"
            print(f"goal p50 <= 0.5 ms, {r['tokenizer']}, {r['scenario']}: {met}")
    path = save(
        "router_tokenize",
        {
            "benchmark": "router_tokenize",
            "commit": commit(),
            "machine": machine(),
            "block_size": BLOCK_SIZE,
            "target_prompt_tokens": TARGET_TOKENS,
            "bpe32k_vocab": bpe.vocab_size,
            "bpe32k_train_s": round(train_s, 1),
            "concurrency": 1,
            "transformers_render": hf_makers["reference"] is not None,
            "goal": "added p50 <= 0.5 ms for a 2,000-token prompt with a cached prefix",
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
