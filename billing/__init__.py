"""Flatfare billing: the request ledger (and, with plans, quotas and Stripe, what it is charged)."""
