"""Metrale ep package."""
