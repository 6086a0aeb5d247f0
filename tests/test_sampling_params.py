"""SamplingParams refuses what the sampler cannot use: non-finite floats in every float field, out-of-range values."""

from __future__ import annotations

import math

import pytest

from leanlm.sampling_params import SamplingParams

FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_floats_are_refused(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("bias", [math.inf, -math.inf, math.nan])
def test_non_finite_logit_bias_is_refused(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: bias})


def test_finite_values_and_integers_are_accepted():
    params = SamplingParams(temperature=0, top_p=1, repetition_penalty=2, presence_penalty=-2, logit_bias={5: -100})
    assert params.repetition_penalty == 2 and params.logit_bias == ((5, -100.0),)
