"""The step-time model that admission estimates use: it must learn an affine cost from mixed steps, follow
a machine that slows down, and stay sane when every step looks the same."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine.step_time import StepTimeModel


def truth(decodes: int, prefill: int, fixed: float = 0.014, per_decode: float = 0.00085,
          per_token: float = 0.0003) -> float:
    return fixed + per_decode * decodes + per_token * prefill


def serving_mix(rng: random.Random) -> tuple[int, int]:
    """Mostly decode steps of a changing batch, some with a prefill chunk, as a server runs them."""
    decodes = rng.randint(1, 64)
    prefill = rng.choice([0, 0, 0, rng.randint(16, 1024)])
    return decodes, prefill


def test_learns_the_fixed_part_a_single_rate_leaves_out():
    rng, model = random.Random(0), StepTimeModel()
    for _ in range(300):
        d, p = serving_mix(rng)
        model.observe(d, p, truth(d, p) * rng.uniform(0.95, 1.05))
    assert model.fixed_s == pytest.approx(0.014, rel=0.15)
    assert model.per_decode_s == pytest.approx(0.00085, rel=0.1)
    assert model.per_prefill_token_s == pytest.approx(0.0003, rel=0.1)
    # 1 decode vs 32: 14.9 vs 41.2 ms; tokens/s measured at one size is wrong at the other by 2.8x.
    assert model.predict(1) == pytest.approx(truth(1, 0), rel=0.1)
    assert model.predict(32) == pytest.approx(truth(32, 0), rel=0.05)
    assert model.prefill_seconds(2048, 32, 2048) == pytest.approx(2 * truth(32, 0) + 2048 * 0.0003, rel=0.05)


def test_follows_a_machine_that_slows_down():
    rng, model = random.Random(1), StepTimeModel()
    for _ in range(200):
        d, p = serving_mix(rng)
        model.observe(d, p, truth(d, p))
    for _ in range(150):  # a noisy neighbour: every step takes 1.5x as long from now on
        d, p = serving_mix(rng)
        model.observe(d, p, 1.5 * truth(d, p))
    for d, p in [(1, 0), (32, 0), (64, 0), (16, 512)]:
        assert model.predict(d, p) == pytest.approx(1.5 * truth(d, p), rel=0.1)


def test_steps_that_all_look_alike_predict_themselves_and_keep_the_defaults_elsewhere():
    model = StepTimeModel()
    for _ in range(5000):
        model.observe(64, 0, 0.07)
    assert model.predict(64) == pytest.approx(0.07, rel=1e-2)  # the ridge leans a little to the defaults
    for d, p in [(0, 0), (1, 0), (64, 2048)]:
        assert 0.0 < model.predict(d, p) < 10.0
    assert model.per_prefill_token_s == pytest.approx(StepTimeModel().per_prefill_token_s, rel=0.05)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 1, 2, 32, 64, 128]), st.sampled_from([0, 1, 64, 256, 2048, 4096]),
                          st.floats(1e-5, 10.0)), max_size=400))
def test_any_history_predicts_positive_and_a_window_of_real_steps_sets_the_fit(history):
    """Whatever ran before (idle ticks, outliers, another machine), the model never predicts a step of
    zero time (the scheduler divides by it: a server once failed on that) and one window of steps of
    the current regime gives it back within a few percent."""
    rng, model = random.Random(2), StepTimeModel()
    for d, p, sec in history:
        model.observe(d, p, sec)
        assert model.predict(1) > 0 and model.predict(64) > 0
    for _ in range(model.window):
        d, p = serving_mix(rng)
        model.observe(d, p, truth(d, p))
    for d, p in [(1, 0), (32, 0), (64, 512)]:
        assert model.predict(d, p) == pytest.approx(truth(d, p), rel=0.06)


def test_ignores_empty_and_zero_time_steps_and_never_predicts_negative():
    model = StepTimeModel()
    model.observe(0, 0, 0.5)
    model.observe(8, 0, 0.0)
    assert model.observations == 0
    for _ in range(100):  # prefill looks free next to a large fixed part: its coefficient clamps at 0
        model.observe(1, 100, 0.05)
        model.observe(1, 0, 0.06)
    assert model.per_prefill_token_s >= 0.0 and model.predict(1, 4096) > 0.0


def test_prefill_seconds_counts_one_chunk_per_step_beside_the_decodes():
    model = StepTimeModel(fixed_s=0.01, per_decode_s=0.001, per_prefill_token_s=0.0001)
    assert model.prefill_seconds(0, 10, 100) == 0.0
    # 100-token budget less 10 decodes: 90 tokens a step, so 200 tokens take 3 steps.
    assert model.prefill_seconds(200, 10, 100) == pytest.approx(3 * 0.02 + 200 * 0.0001)
    assert model.prefill_seconds(5, 200, 100) == pytest.approx(5 * (0.01 + 0.2) + 5 * 0.0001)  # one a step
