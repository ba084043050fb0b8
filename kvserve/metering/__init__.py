"""Metering: what a request is charged (prices) and what it cost (engine time), budgets and rate limits."""
