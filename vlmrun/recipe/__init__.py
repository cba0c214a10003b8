"""Recipes: the typed, validated description of a run."""
