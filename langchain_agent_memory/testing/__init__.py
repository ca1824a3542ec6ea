"""Helpers for tests and benchmarks: random-weight models, quality measures, a text corpus."""
