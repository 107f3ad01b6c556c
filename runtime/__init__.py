"""Metrale runtime package."""
