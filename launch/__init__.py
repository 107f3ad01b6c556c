"""Metrale launch package."""
