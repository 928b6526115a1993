"""Corpus -> GPT-2 token shards in the llm.c format: parallel, streaming, restartable, checked.

    python -m data_prep --source PATH [PATH ...] --out DIR [--shard-tokens N] [--val-tokens N] [--workers N]
    python -m data_prep --hf-dataset NAME [--hf-config CONFIG] [--hf-split train] --out DIR [...]
    python -m data_prep verify DIR

Modules: config (PrepConfig, UserError), sources (files/HF dataset -> record texts), encode (ordered
parallel tokenization), writer (shards + manifest + resume), verify, pipeline (one job), __main__ (CLI).
Importing the package has no side effects.
"""
