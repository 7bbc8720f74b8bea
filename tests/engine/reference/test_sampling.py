"""Sampling parameters, through the sampler and through the engine's stop logic."""

from __future__ import annotations

import pytest
import torch

from fleetpilot.engine.reference import SamplingParams
from fleetpilot.engine.reference.sampling import probs_from_logits, sample
from fleetpilot.engine.reference.tokenizer import EOS_TOKEN_ID
from tests.engine.reference.conftest import EngineFactory, eos_model

PROMPTS = ["The quick brown fox", "Lorem ipsum dolor sit amet", "fleetpilot"]


def test_top_k_and_top_p_keep_the_right_tokens() -> None:
    """top-k keeps the k most likely; top-p keeps the smallest set reaching p (at least one)."""
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    assert probs_from_logits(logits, SamplingParams(top_k=2))[0].tolist() == pytest.approx(
        [2 / 3, 1 / 3, 0, 0]
    )
    assert probs_from_logits(logits, SamplingParams(top_p=0.7))[0].tolist() == pytest.approx(
        [2 / 3, 1 / 3, 0, 0]
    )
    assert probs_from_logits(logits, SamplingParams(top_p=0.1))[0].tolist() == [1, 0, 0, 0]
    hot = probs_from_logits(logits, SamplingParams(temperature=0.5))[0]
    assert hot[0] == pytest.approx(0.25 / (0.25 + 0.0625 + 0.0225 + 0.01))


def test_greedy_consumes_no_randomness() -> None:
    """Greedy rows are the argmax and leave the generator untouched."""
    gen = torch.Generator().manual_seed(3)
    state = gen.get_state()
    logits = torch.randn(5, 10, generator=torch.Generator().manual_seed(0))
    assert sample(logits, SamplingParams(temperature=0), gen) == logits.argmax(-1).tolist()
    assert torch.equal(gen.get_state(), state)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_invalid_sampling_params_are_refused(kwargs: dict[str, object], message: str) -> None:
    """Out-of-range parameters fail at construction, before reaching the engine."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_top_k_1_equals_greedy(make_engine: EngineFactory) -> None:
    """top_k=1 at temperature 1 produces exactly the greedy tokens."""
    greedy = make_engine().generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0))
    topk1 = make_engine().generate(PROMPTS, SamplingParams(max_tokens=20, top_k=1))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk1]


def test_seed_makes_sampling_reproducible_across_batches(make_engine: EngineFactory) -> None:
    """A seeded request samples the same tokens alone or batched with others, and another seed
    samples different ones."""
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=42)
    alone = make_engine().generate([PROMPTS[0]], seeded)[0].token_ids
    engine = make_engine()
    engine.add_request("noise", PROMPTS[1], SamplingParams(max_tokens=30, temperature=1.0))
    batched = engine.generate([PROMPTS[0], PROMPTS[2]], seeded)[0].token_ids
    assert alone == batched
    other = make_engine().generate([PROMPTS[0]], SamplingParams(max_tokens=24, seed=43))
    assert other[0].token_ids != alone


def test_unseeded_sampling_differs_between_requests(make_engine: EngineFactory) -> None:
    """Without a seed, two identical requests do not draw the same random tokens."""
    a, b = make_engine().generate([PROMPTS[0]] * 2, SamplingParams(max_tokens=24))
    assert a.token_ids != b.token_ids


def test_stop_string_truncates_the_text_and_reports_it(make_engine: EngineFactory) -> None:
    """Generation ends at the first stop string; the text excludes it unless asked to keep it."""
    free = make_engine().generate([PROMPTS[0]], SamplingParams(max_tokens=40, temperature=0))[0]
    data = bytes(t for t in free.token_ids if t < 256)
    stop = data[10:13].decode("utf-8", errors="ignore") or "x"
    full_text = data.decode("utf-8", errors="replace")
    at = full_text.find(stop)
    assert at >= 0
    out = make_engine().generate(
        [PROMPTS[0]], SamplingParams(max_tokens=40, temperature=0, stop=(stop, "\x00never"))
    )[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == full_text[:at]
    assert len(out.token_ids) < 40
    kept = make_engine().generate(
        [PROMPTS[0]],
        SamplingParams(max_tokens=40, temperature=0, stop=(stop,), include_stop_str_in_output=True),
    )[0]
    assert kept.text == full_text[: at + len(stop)]


def test_stop_token_ids_and_max_tokens(make_engine: EngineFactory) -> None:
    """A stop token ends generation with it as stop_reason; otherwise max_tokens ends it."""
    free = make_engine().generate([PROMPTS[1]], SamplingParams(max_tokens=30, temperature=0))[0]
    assert free.finish_reason == "length"
    assert len(free.token_ids) == 30
    stop_token = free.token_ids[12]
    first = free.token_ids.index(stop_token)
    out = make_engine().generate(
        [PROMPTS[1]], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=(stop_token,))
    )[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_token


def test_eos_stops_unless_ignore_eos(make_engine: EngineFactory) -> None:
    """EOS finishes a request with reason "stop"; with ignore_eos it runs to max_tokens."""
    model = eos_model()
    stopped = make_engine(model).generate(["hi"], SamplingParams(temperature=0))[0]
    assert stopped.token_ids == (EOS_TOKEN_ID,)
    assert stopped.finish_reason == "stop"
    assert stopped.text == ""
    ignored = make_engine(model).generate(
        ["hi"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    )[0]
    assert ignored.token_ids == (EOS_TOKEN_ID,) * 5
    assert ignored.finish_reason == "length"
