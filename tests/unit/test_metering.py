"""Metering's pure parts: prices and costs."""
from __future__ import annotations

import pytest

from kvserve.config import ConfigError


def test_prices_and_costs():
    from kvserve.config import ModelPrice
    from kvserve.metering.prices import request_cost, request_price, worst_case_price

    p = ModelPrice(input=1.0, cached_input=0.25, output=4.0, batch_discount=0.5, replica_cost_per_hour=36.0)
    # 1000 prompt tokens, 400 of them cached, 100 out: (600 x 1 + 400 x 0.25 + 100 x 4) per million
    assert request_price(p, "interactive", 1000, 400, 100) == pytest.approx(1100e-6)
    assert request_price(p, "batch", 1000, 400, 100) == pytest.approx(550e-6)
    assert worst_case_price(p, "interactive", 1000, 256) == pytest.approx((1000 + 4 * 256) * 1e-6)
    assert worst_case_price(p, "interactive", 1000, 256) >= request_price(p, "interactive", 1000, 999, 256)
    assert request_cost(p, 2.0) == pytest.approx(0.02)  # 2 s at $36/h
    with pytest.raises(ConfigError, match="batch_discount"):
        ModelPrice(batch_discount=0)


@pytest.mark.parametrize("amount, text", [
    (0.0, "$0.00"), (1234.567, "$1,234.57"), (12.0, "$12.00"), (0.5, "$0.50"), (0.125, "$0.125"),
    (0.0101, "$0.0101"), (0.000123456, "$0.000123"), (1e-7, "$0.0000001"), (0.0099999, "$0.01"),
    (-0.0042, "-$0.0042"), (-3.5, "-$3.50")])
def test_money_reads_as_itself(amount, text):
    """Cents, or three significant digits where cents show fewer: a sub-cent amount is never "$0.000000"."""
    from kvserve.metering.money import format_money

    assert format_money(amount) == text


def test_break_even_prices_hand_worked():
    """1 ms of engine time per token on a $0.36/hour replica is $0.0001 a thousand tokens, $0.10 a million;
    busy half the hour, the tokens it serves also pay for the idle half: $0.20."""
    from kvserve.config import ModelPrice
    from kvserve.metering.prices import break_even_price, list_price

    p = ModelPrice(replica_cost_per_hour=0.36)
    assert break_even_price(p, 0.001, utilization=1.0) == pytest.approx(0.10)
    assert break_even_price(p, 0.001) == pytest.approx(0.20)  # the default utilization: 50%
    assert break_even_price(p, 0.001, utilization=0.25) == pytest.approx(0.40)
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="utilization"):
            break_even_price(p, 0.001, utilization=bad)
    assert list_price(0.20, 1.0) == pytest.approx(0.40)
    assert list_price(0.0123, 0.0) == pytest.approx(0.013)  # rounded up, never below
    assert list_price(0.228, 1.0) == pytest.approx(0.46) and list_price(0.0, 1.0) == 0.0
