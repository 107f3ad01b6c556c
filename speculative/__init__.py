"""Metrale speculative package."""
