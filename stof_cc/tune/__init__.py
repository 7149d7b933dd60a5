"""Tuning: the analytical cost model (stage 1 of the search)."""
