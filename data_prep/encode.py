"""Records -> GPT-2 tokens, in order, in parallel processes with bounded memory.

Named encode.py, not tokenize.py, so it cannot shadow the standard library's `tokenize` module.

Each document becomes [EOT] + encode_ordinary(text). Long documents are cut into pieces at points
where the GPT-2 pre-tokenizer regex splits anyway, so the pieces tokenize to exactly the tokens of
the whole text (see split_text); this keeps batches small enough to spread over workers and keeps
a 100 MB .txt file from turning into a 3 GB Python list of ints in one worker.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field

import numpy as np

from data_prep.prep_config import UserError, WorkerDied
from gpt2.core.config import EOT_TOKEN

BATCH_CHARS = 1 << 18
"""Characters per batch sent to a worker (~60 ms of tiktoken work): large enough that pickling and
queueing cost little, small enough that 2 workers x a few batches in flight stay a few MB."""
IN_FLIGHT_PER_WORKER = 4
"""Batches queued or running per worker: enough to keep workers busy while the main process reads."""
UINT16_MAX = 65535
_EOT = np.array([EOT_TOKEN], dtype=np.uint32)

# A cut before position i is exact when text[i] is ' ' or '\n' and text[i-1] is not whitespace:
# none of the GPT-2 pattern's alternatives ('s|'t|...| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|
# \s+(?!\S)|\s+) can match across a non-space -> space boundary, and the pattern has no lookbehind,
# so the pre-tokenized pieces (and hence the BPE tokens) on each side are those of the whole text.
# Python's \S is stricter than Unicode White_Space (it also treats \x1c-\x1f as space), so a char
# that is \S here is also non-space for tiktoken's regex.
_SAFE_CUT = re.compile(r"\S(?=[ \n])")


def split_text(text: str, max_chars: int) -> list[str]:
    """Pieces of at most ~max_chars whose tokens, concatenated, equal the tokens of text."""
    if len(text) <= max_chars:
        return [text]
    pieces = []
    start = 0
    while len(text) - start > max_chars:
        cut = _last_safe_cut(text, start + max_chars // 2, start + max_chars)
        if cut is None:  # no space in the window (e.g. minified data): take the next safe point
            m = _SAFE_CUT.search(text, start + max_chars)
            if m is None:
                break
            cut = m.end()
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def _last_safe_cut(text: str, lo: int, hi: int) -> int | None:
    i = hi
    while True:
        i = max(text.rfind(" ", lo, i), text.rfind("\n", lo, i))
        if i <= lo:
            return None
        if not text[i - 1].isspace():
            return i


@dataclass
class Batch:
    """Pieces of documents sent to a worker together, with where each belongs."""

    texts: list[str] = field(default_factory=list)
    records: list[int] = field(default_factory=list)
    first: list[bool] = field(default_factory=list)
    """The piece starts its document (gets the EOT)."""
    last: list[bool] = field(default_factory=list)
    """The piece ends its document."""
    chars: int = 0

    def add(self, text: str, record: int, first: bool, last: bool) -> None:
        self.texts.append(text)
        self.records.append(record)
        self.first.append(first)
        self.last.append(last)
        self.chars += len(text)


def make_batches(records: Iterator[tuple[int, str]], batch_chars: int = BATCH_CHARS) -> Iterator[Batch]:
    """Group (record number, text) pairs into batches of about batch_chars characters."""
    batch = Batch()
    for record, text in records:
        pieces = split_text(text, batch_chars)
        for k, piece in enumerate(pieces):
            batch.add(piece, record, k == 0, k == len(pieces) - 1)
            if batch.chars >= batch_chars:
                yield batch
                batch = Batch()
    if batch.texts:
        yield batch


_encoding = None


def init_worker(ignore_sigint: bool = True, parent_pid: int | None = None) -> None:
    """Pool initializer: load the encoding once per process; Ctrl-C is the parent's to handle, and a
    worker does not outlive its parent (parent_pid).

    The parent starts workers with SIGINT blocked (see submit): a Ctrl-C while a worker was still
    starting (Python's start-up, the imports) reached it before SIG_IGN did, and it printed a
    KeyboardInterrupt traceback under data_prep's "interrupted" line. Unblocked only once ignored, a
    Ctrl-C that came meanwhile is dropped here.
    """
    global _encoding
    from gpt2.model.tokenizer import get_encoding

    if ignore_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if parent_pid is not None:
        die_with_parent(parent_pid)
    _encoding = get_encoding()


PR_SET_PDEATHSIG = 1
"""<linux/prctl.h>: the signal a process gets when its parent exits."""


def die_with_parent(parent_pid: int) -> None:
    """End this worker, without a word, as soon as parent_pid is gone.

    After kill -9 of data_prep (or of its process group, by a scheduler or a shell) a worker that was
    tokenizing has no one to send its tokens to: Pool's put() raised BrokenPipeError, and every
    worker printed two tracebacks onto the job's log, which read like a crash of its own. Linux
    delivers SIGKILL to the worker when its parent exits (PR_SET_PDEATHSIG); elsewhere a thread
    polls for the parent. A parent that died before this ran is caught by the getppid() check.

    PR_SET_PDEATHSIG fires when the THREAD that created the worker exits, not its process: every
    worker is created by the thread iterating encode_batches (ProcessPoolExecutor starts workers in
    submit(), from the calling thread, in Python 3.10-3.13; only max_tasks_per_child, unused here,
    makes its manager thread start one), data_prep's main thread, which lives as long as the run.
    multiprocessing.Pool started the replacement of a dead worker from its worker-handler thread,
    whose exit then killed it.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    else:

        def watch() -> None:
            while os.getppid() == parent_pid:
                time.sleep(0.5)
            os._exit(0)

        threading.Thread(target=watch, daemon=True, name="parent-watch").start()
    if os.getppid() != parent_pid:
        os._exit(0)


def encode_pieces(job: tuple[list[str], list[bool]]) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of the pieces concatenated (uint16), and each piece's token count (EOT included).

    encode_to_numpy with no special tokens allowed and none disallowed is encode_ordinary (special
    token text is plain text; tests compare against encode_ordinary) but hands back a uint32 buffer
    instead of a list of Python ints: ~10% less CPU per token.
    """
    texts, first = job
    parts = []
    counts = np.empty(len(texts), dtype=np.int64)
    for i, (text, starts_doc) in enumerate(zip(texts, first)):
        tokens = _encoding.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
        if starts_doc:
            parts.append(_EOT)
        parts.append(tokens)
        counts[i] = len(tokens) + starts_doc
    array = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)
    if array.size and array.max() > UINT16_MAX:
        raise UserError(
            f"token id {int(array.max())} does not fit in uint16 (0..{UINT16_MAX}); "
            "the llm.c shard format only holds GPT-2-sized vocabularies"
        )
    return array.astype(np.uint16), counts


RESOURCE_TRACKER_QUIET = "ignore:resource_tracker:UserWarning"
"""A -W option: after kill -9 of data_prep, multiprocessing's resource tracker (started with the pool,
and given the parent's -W options) unlinks the pool's semaphores itself and warns that they "appear to
be leaked": true, harmless, and the rerun resumes; to a user it read as a second failure."""


def quiet_resource_tracker() -> None:
    if RESOURCE_TRACKER_QUIET not in sys.warnoptions:
        sys.warnoptions.append(RESOURCE_TRACKER_QUIET)


def encode_batches(batches: Iterator[Batch], workers: int) -> Iterator[tuple[Batch, np.ndarray, np.ndarray]]:
    """(batch, tokens, counts) in input order, tokenized by `workers` processes.

    Pool.imap would do the ordering, but its feeder thread drains the input iterator as fast as it
    can (Pool.imap is not lazy), i.e. reads the whole corpus into the task queue. A window of futures
    keeps at most workers * IN_FLIGHT_PER_WORKER batches in memory.

    ProcessPoolExecutor, not multiprocessing.Pool: when a worker dies (the OOM killer, kill -9), Pool
    started a replacement and the dead worker's task's result never came: data_prep waited forever at
    0% CPU, without a word. The executor fails every future in flight with BrokenProcessPool instead,
    which ends the job with WorkerDied's one line. Iterate it from the thread that lives as long as the
    workers should (see die_with_parent).
    """
    if workers == 1:
        init_worker(ignore_sigint=False)
        for batch in batches:
            yield (batch, *encode_pieces((batch.texts, batch.first)))
        return
    quiet_resource_tracker()
    pool = start_pool(workers)
    # The executor's own record of its workers (pid -> Process; the one private name used, the same in
    # Python 3.10-3.13): read after a death for its exit status. shutdown() drops the attribute, not the dict.
    processes = getattr(pool, "_processes", {})
    pending: deque = deque()
    try:
        for batch in batches:
            pending.append((batch, submit(pool, batch)))
            if len(pending) >= workers * IN_FLIGHT_PER_WORKER:
                done, future = pending.popleft()
                yield (done, *future.result())
        while pending:
            done, future = pending.popleft()
            yield (done, *future.result())
    except BrokenProcessPool:
        pool.shutdown(wait=True)  # the manager thread has joined every worker when it returns: exit codes known
        raise WorkerDied(worker_death(list(processes.values()))) from None
    finally:  # also when the caller stops early (a repair's last shard written) or raises
        shut_down(pool, processes)


def start_pool(workers: int) -> ProcessPoolExecutor:
    """The executor data_prep tokenizes with; its workers start on demand, in submit()."""
    # spawn, not fork: the parent holds datasets/pyarrow threads, and forking threads can deadlock.
    ctx = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(workers, mp_context=ctx, initializer=init_worker, initargs=(True, os.getpid()))


def submit(pool: ProcessPoolExecutor, batch: Batch) -> Future:
    """pool.submit with SIGINT blocked: a worker it starts begins life with SIGINT blocked (fork and
    exec keep the signal mask) until init_worker has set SIG_IGN, so a Ctrl-C during its start-up
    cannot print a traceback. So does the executor's manager thread, started by the first submit:
    SIGINT then always reaches the main thread. A Ctrl-C meanwhile is delivered to data_prep when
    the mask is restored, and ends it as any other. Two system calls per batch of ~60 ms of work."""
    if not hasattr(signal, "pthread_sigmask"):
        return pool.submit(encode_pieces, (batch.texts, batch.first))
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        return pool.submit(encode_pieces, (batch.texts, batch.first))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


RERUN = "the shards written so far are kept: rerun the same command to continue after the last complete shard"


def worker_death(processes: list) -> str:
    """One line for a dead worker: which, how, the likely cause and the way out.

    After a death the executor stops the other workers with SIGTERM, so the first to die is the one
    that did not end by SIGTERM (unless SIGTERM killed it too: then any of them).
    """
    dead = [p for p in processes if p.exitcode is not None]
    first = [p for p in dead if p.exitcode != -signal.SIGTERM] or dead
    if not first:
        return f"a tokenizer worker died; {RERUN}"
    pids = ", ".join(str(p.pid) for p in first)
    who = f"a tokenizer worker (pid {pids})" if len(first) == 1 else f"tokenizer workers (pids {pids})"
    code = first[0].exitcode
    if code >= 0:
        return f"{who} exited with status {code} while tokenizing; {RERUN}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    why = f"{who} was killed by {name}"
    if -code == signal.SIGKILL:
        why += " (the kernel's OOM killer? `dmesg` says so; fewer --workers need less memory)"
    return f"{why}; {RERUN}"


def shut_down(pool: ProcessPoolExecutor, processes: dict) -> None:
    """End the workers without killing them while tasks are in flight.

    multiprocessing.Pool.terminate() (what `with Pool()` did on exit) raced the pool's task-handler
    thread: when it had just taken the next batch (~256 KB pickled, more than a pipe holds) and not yet
    written it, terminate's drain of the task pipe found it empty and stopped, the handler's write then
    blocked forever on a pipe no one would read again, and terminate's join of that thread never
    returned: data_prep hung at 0% CPU with its workers defunct (a repairing rerun stops early, with
    batches in flight: 1 hang in 34 runs; tests/test_data_prep.py's slow stress test repeats it).
    shutdown(cancel_futures=True) drops the batches not yet handed to a worker, waits for the few a
    worker holds (well under a second) and ends the workers with the executor's own sentinels.
    """
    try:
        pool.shutdown(wait=True, cancel_futures=True)
    except BaseException:  # a second Ctrl-C while waiting: out at once, as before
        for process in list(processes.values()):
            process.terminate()
        raise
