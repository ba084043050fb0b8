"""Metering, pure: prices and money, engine-time cost, budget and rate-limit arithmetic, usage reports, the dashboard.

The store keeps their state (store/budgets.py, rate_limits.py, metering.py); the service applies them (service/gate.py).
"""
