"""The SDK's sampling: checked against the contract's bounds before anything is sent, and the verl adapter passing
the sampler's penalties and min_tokens on instead of dropping them."""

from __future__ import annotations

import pytest

from prorsa.client.adapters import sampling_from_dict
from prorsa.client.client import checked_sampling
from proto import SamplingParams


def test_verl_sampling_dicts_keep_penalties_and_min_tokens() -> None:
    # What verl's agent loops send (repetition_penalty is in verl's rollout config), plus vLLM's names.
    params = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05, "logprobs": True}
    params |= {"presence_penalty": 0.5, "frequency_penalty": -0.25, "min_tokens": 3}
    s = sampling_from_dict(params, default_max_tokens=64)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty, s.min_tokens) == (
        1.05,
        0.5,
        -0.25,
        3,
    )
    assert (s.max_tokens, s.temperature, s.top_k) == (64, 0.7, 20)
    neutral = sampling_from_dict({})
    assert (neutral.repetition_penalty, neutral.presence_penalty, neutral.min_tokens) == (1.0, 0.0, 0)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": -3.0}, "presence_penalty"),
        ({"logprobs_mode": "raw_logits"}, "logprobs_mode"),
        ({"min_tokens": -1}, "min_tokens"),
    ],
)
def test_sampling_out_of_bounds_is_refused_before_sending(fields: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        checked_sampling(SamplingParams(max_tokens=8, **fields))
    with pytest.raises(ValueError, match=field):
        checked_sampling({"max_tokens": 8, **fields})


def test_sampling_in_bounds_is_kept_as_given() -> None:
    s = SamplingParams(
        max_tokens=8, top_logprobs=20, repetition_penalty=1.3, logprobs_mode="processed_logprobs"
    )
    assert checked_sampling(s) == s
    with pytest.raises(TypeError):
        checked_sampling({"max_tokens": 8, "no_such_knob": 1})
