"""Corpus -> GPT-2 token shards in the llm.c format: parallel, streaming, restartable, checked.

    python -m data_prep --source PATH [PATH ...] --out DIR [--shard-tokens N] [--val-tokens N]
                        [--val-select spread|first] [--workers N]
    python -m data_prep --hf-dataset NAME [--hf-config CONFIG] [--hf-split train] --out DIR [...]
    python -m data_prep verify DIR

Val split (default): whole documents, taken in the order of a blake2b hash of their text (so from
all over the corpus, whatever its order, --workers or interruptions) until they hold
min(10M, max(1% of E, min(16,384, 10% of E))) tokens, E = source bytes / 4: 1% of a large corpus,
at least the 16,384 tokens a small preset evaluates on, but never more than 10% of a tiny corpus
for that floor. An explicit --val-tokens N alone keeps the earlier rule (the first documents in
source order, as many scripts expect); --val-select spread|first chooses either way. A .txt file is
one document unless --txt-sample-by paragraph.

A rerun of the same command resumes an interrupted job, and over a finished one checks every
shard's size and sha256 and re-encodes the missing or damaged ones (verify reports them).

Modules: prep_config (PrepConfig, UserError), sources (files/HF dataset -> record texts), encode (ordered
parallel tokenization), shard_writer (shards + manifest + resume), verify, pipeline (one job), __main__
(CLI).
Importing the package has no side effects.
"""
