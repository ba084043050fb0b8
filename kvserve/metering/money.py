"""How an amount of money is written for people: messages, CLI tables, planner reports (pure).

Cents, or three significant digits where cents would show fewer, so a sub-cent budget left or a price per
token reads as itself ("$0.000123") and not as "$0.000000" or "$0.00". Machine output (JSON, CSV) keeps the
raw numbers. The dashboard formats in its own JavaScript (metering/dashboard/dashboard.js, `money`, by the same rule).
"""
from __future__ import annotations

import math

CURRENCY = "$"  # prices, budgets and costs are in dollars
SIGNIFICANT = 3
CENTS = 2


def format_money(amount: float) -> str:
    """`amount` dollars as "$1,234.57", "$0.125", "$0.000123", "-$0.0042" or "$0.00"."""
    if not math.isfinite(amount):
        return f"{CURRENCY}{amount}"
    size = abs(amount)
    decimals = CENTS if size == 0 else max(CENTS, SIGNIFICANT - 1 - math.floor(math.log10(size)))
    text = f"{size:,.{decimals}f}"
    whole, _, frac = text.partition(".")
    frac = frac.rstrip("0").ljust(CENTS, "0")  # no trailing zeros beyond the cents
    return f"{'-' if amount < 0 else ''}{CURRENCY}{whole}.{frac}"
