"""data_prep throughput and memory: --workers 1 vs 2 beside raw single-thread tiktoken.

    python bench/prep_throughput.py            # 20 MB corpus
    python bench/prep_throughput.py --large    # 20 MB and 200 MB (memory must not grow with the corpus)
    python bench/prep_throughput.py --mb 1024 --rounds 2    # ~13 min: start-up amortised

Builds a JSON-lines corpus from --corpus (default: the shared tinyshakespeare.txt; repeated; documents of ~20
paragraphs,
~3 KB, like web documents) in a temp dir, runs `python -m data_prep` on it as a subprocess, and
prints a Markdown table. -w1 and -w2 run alternately, --rounds times each (the machine's speed drifts
between runs; alternating puts both under the same drift), and the table gives medians. Peak RSS is sampled from /proc
every 20 ms and summed over the whole
process tree (main process + tokenizer workers); the largest single process is shown too.
The machine may be shared: the 1-minute load average is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from corpus import add_corpus_flag, require_corpus  # bench/corpus.py (a script's directory is on sys.path)

REPO = Path(__file__).resolve().parent.parent
PARAGRAPHS_PER_DOC = 20
SHARD_TOKENS = 1_000_000
"""Small shards so both corpus sizes span many shards: the shard buffer (2 bytes/token) is then the
same for both, and any growth of memory with the corpus would show. At the default 100M tokens the
buffer alone is 200 MB, touched page by page as the first shard fills."""


def build_corpus(path: Path, target_bytes: int, source: Path) -> int:
    """Write source (Shakespeare) as JSON lines until target_bytes of text; return the number of documents."""
    paragraphs = [p for p in source.read_text().split("\n\n") if p]
    docs = ["\n\n".join(paragraphs[i : i + PARAGRAPHS_PER_DOC]) for i in range(0, len(paragraphs), PARAGRAPHS_PER_DOC)]
    written = n = 0
    with open(path, "w") as f:
        while written < target_bytes:
            for doc in docs:
                f.write(json.dumps({"text": doc}) + "\n")
                written += len(doc)
                n += 1
    return n


def raw_tiktoken_rate(path: Path) -> tuple[float, float, int]:
    """Single-thread encode_ordinary over the same documents (JSON decoding not timed):
    (tokens per wall second, tokens per CPU second, tokens)."""
    sys.path.insert(0, str(REPO))
    from gpt2.model.tokenizer import get_encoding

    enc = get_encoding()
    with open(path) as f:
        docs = [json.loads(line)["text"] for line in f]
    start, cpu = time.perf_counter(), time.process_time()
    n = sum(len(enc.encode_ordinary(d)) + 1 for d in docs)  # +1: the EOT data_prep adds
    return n / (time.perf_counter() - start), n / (time.process_time() - cpu), n


def _encode_count(docs: list[str]) -> int:
    from gpt2.model.tokenizer import get_encoding

    enc = get_encoding()
    return sum(len(enc.encode_ordinary(d)) + 1 for d in docs)


def raw_tiktoken_two_process_rate(path: Path) -> float:
    """The machine's own ceiling: two processes each encoding half the documents, no data_prep
    (pool start-up and encoding load excluded). On an idle 2-core machine this is ~2x raw."""
    import multiprocessing

    with open(path) as f:
        docs = [json.loads(line)["text"] for line in f]
    halves = [docs[0::2], docs[1::2]]
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.map(_encode_count, [["warm up"], ["warm up"]])
        start = time.perf_counter()
        n = sum(pool.map(_encode_count, halves, chunksize=1))
        return n / (time.perf_counter() - start)


def tree_rss_bytes(pid: int) -> tuple[int, int]:
    """(sum, max) of VmRSS over pid and all its descendants."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        ppid = int(re.search(r"^PPid:\s+(\d+)", status, re.M).group(1))
        children.setdefault(ppid, []).append(int(entry))
        m = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
        rss[int(entry)] = int(m.group(1)) * 1024 if m else 0
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    values = [rss.get(p, 0) for p in tree]
    return sum(values), max(values)


def run_data_prep(corpus: Path, out: Path, workers: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "data_prep",
        "--source",
        str(corpus),
        "--out",
        str(out),
        "--workers",
        str(workers),
        "--shard-tokens",
        str(SHARD_TOKENS),
        "--val-tokens",
        "0",
        "--no-progress",
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak_sum = peak_one = 0
    while proc.poll() is None:
        s, m = tree_rss_bytes(proc.pid)
        peak_sum, peak_one = max(peak_sum, s), max(peak_one, m)
        time.sleep(0.02)
    wall = time.perf_counter() - start
    stdout, stderr = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"data_prep failed ({proc.returncode}):\n{stderr}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # includes the pool workers (reaped by data_prep)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    m = re.search(r"tokens ([\d,]+) .*elapsed ([\d.]+) s", stdout)
    tokens, elapsed = int(m.group(1).replace(",", "")), float(m.group(2))
    return {
        "tokens": tokens,
        "rate": tokens / elapsed,
        "wall_s": wall,
        "cpu_s": cpu,
        "peak_sum": peak_sum,
        "peak_one": peak_one,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--large", action="store_true", help="also run a 200 MB corpus")
    p.add_argument("--mb", type=int, nargs="*", help="corpus sizes in MB (default 20, or 20 200 with --large)")
    p.add_argument("--rounds", type=int, default=3, help="alternating runs of -w1 and -w2 per corpus size")
    add_corpus_flag(p)
    args = p.parse_args(argv)
    require_corpus(args.corpus, "prep_throughput.py")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    sizes = args.mb or ([20, 200] if args.large else [20])
    rows = []
    with tempfile.TemporaryDirectory(prefix="prep_bench_") as tmp:
        for mb in sizes:
            corpus = Path(tmp) / f"corpus_{mb}mb.jsonl"
            n_docs = build_corpus(corpus, mb * 2**20, args.corpus)
            raw, raw_cpu, raw_tokens = raw_tiktoken_rate(corpus)
            raw2 = raw_tiktoken_two_process_rate(corpus)
            runs, ratios = {1: [], 2: []}, []
            for r in range(args.rounds):  # alternate the order (1 2, 2 1, ...): the machine's speed drifts
                for w in (1, 2) if r % 2 == 0 else (2, 1):
                    runs[w].append(run_data_prep(corpus, Path(tmp) / f"out_{mb}_{w}", w))
                assert runs[1][-1]["tokens"] == runs[2][-1]["tokens"] == raw_tokens, (runs, raw_tokens)
                ratios.append(runs[2][-1]["rate"] / runs[1][-1]["rate"])
                same = all(
                    (Path(tmp) / f"out_{mb}_1" / f.name).read_bytes() == f.read_bytes()
                    for f in sorted((Path(tmp) / f"out_{mb}_2").glob("*.bin"))
                )
                for w in (1, 2):
                    shutil.rmtree(Path(tmp) / f"out_{mb}_{w}")
                print(f"  {mb} MB round {r + 1}/{args.rounds}: -w2/-w1 {ratios[-1]:.2f}x", file=sys.stderr, flush=True)
                if not same:
                    break
            merged = {
                w: {
                    "rate": statistics.median(x["rate"] for x in runs[w]),
                    "cpu_s": statistics.median(x["cpu_s"] for x in runs[w]),
                    "peak_sum": max(x["peak_sum"] for x in runs[w]),
                    "peak_one": max(x["peak_one"] for x in runs[w]),
                }
                for w in (1, 2)
            }
            rows.append((mb, n_docs, raw_tokens, raw, raw_cpu, raw2, merged, same, ratios))
            corpus.unlink()
    mib = 2**20
    print(
        f"cores available: {len(os.sched_getaffinity(0))}; 1-min load average at the end: {os.getloadavg()[0]:.1f}"
        f" (a shared machine: other jobs compete for the cores)"
    )
    print(f"command: python bench/prep_throughput.py {' '.join(argv if argv is not None else sys.argv[1:])}".rstrip())
    print()
    print(
        "| corpus | tokens | raw tiktoken 1 proc tok/s | raw tiktoken 2 procs tok/s (ceiling) | data_prep -w1 tok/s "
        "| data_prep -w2 tok/s | w2/w1 (per round) | CPU s: raw / -w1 / -w2 | peak RSS tree -w1 "
        "| peak RSS tree -w2 (largest proc) | bytes w1 == w2 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for mb, n_docs, tokens, raw, raw_cpu, raw2, runs, same, ratios in rows:
        r1, r2 = runs[1], runs[2]
        print(
            f"| {mb} MB ({n_docs:,} docs) | {tokens:,} | {raw:,.0f} | {raw2:,.0f} ({raw2 / raw:.2f}x) "
            f"| {r1['rate']:,.0f} | {r2['rate']:,.0f} "
            f"| {r2['rate'] / r1['rate']:.2f}x ({', '.join(f'{x:.2f}' for x in ratios)}) | {tokens / raw_cpu:.1f} / "
            f"{r1['cpu_s']:.1f} / {r2['cpu_s']:.1f} "
            f"| {r1['peak_sum'] / mib:.0f} MiB | {r2['peak_sum'] / mib:.0f} MiB ({r2['peak_one'] / mib:.0f}) "
            f"| {'yes' if same else 'NO'} |"
        )
    print()
    print(
        f"-w1 and -w2 ran alternately {args.rounds} times each (1 2, 2 1, ...); tok/s and CPU s are medians "
        f"over the rounds, peak RSS the maximum. ",
        end="",
    )
    print(
        f"tok/s = tokens / data_prep's own elapsed time (planning, pool start-up, tokenizing, writing shards "
        f"with fsync); CPU s = user+sys of the whole process tree (robust to other jobs on the machine, unlike "
        f"tok/s); --shard-tokens {SHARD_TOKENS:,}, --val-tokens 0; corpus: JSON lines, "
        f"~{PARAGRAPHS_PER_DOC} Shakespeare paragraphs per document."
    )


if __name__ == "__main__":
    main()
