"""Rank 0's step: schedule, propose, verify, commit (docs/design.md §2)."""
