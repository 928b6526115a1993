"""Tokens in: the .bin shard format (shards.py), the rank-aware loaders (loader.py), the epoch
permutation (permutation.py), the data checks (check.py), HellaSwag's examples (hellaswag.py)."""
