"""Rank 0's step: schedule, propose, verify, commit (DESIGN §2)."""
