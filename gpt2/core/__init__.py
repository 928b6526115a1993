"""Foundations every other part uses: the validated run config, torch-version capabilities, precision
(dtypes, autocast), the schedule and batch maths, atomic file writes. Imports nothing else of gpt2."""
