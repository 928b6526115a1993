"""Several corpora in one run (--data-dir A,B --data-weights 0.75,0.25): which source each training
sequence comes from, and the loader that reads them.

The schedule. Global sequence i is what the single-source loader calls window place i: optimizer step s
takes sequences [s*R, (s+1)*R) (R = global batch tokens / seq_len) and rank r's micro-step m its rows
(m*world + r)*B ... +B, so a mixture keeps what that loader promises: the same global batches at any world
size, disjoint ranks, and one number of state (the position) besides the weights' history. Which source
sequence i is drawn from is a pure function of i and the integer weights (the weights normalised, in units
of 1/QUANTUM): the sources are split in two halves, and sequence j of a node goes to its left half iff
round((j+1) w) > round(j w), w the left half's share of the node's weight; round(j w) sequences of the
node's first j went left. The halves are split again until one source is left. So the count of source k
among the first n sequences is a closed form (drawn(), O(sources) integer operations, exact), each half
gets its share within half a sequence at every prefix, and a source within about half a sequence per level
(at most 1.5 sequences for 8 sources), at every scale: no burst of one source, at any position.

Each source reads its own windows in its own order: the k-th sequence drawn from a source is that source's
window place k, shuffled (a Feistel Permutation per epoch, keyed by --seed and the source's name) or
sequential, as one corpus alone would be read. A source whose places run past its windows starts a new
epoch of its own (a new permutation) and the log says so; metrics.jsonl carries each source's tokens and
epochs.

Weights that change: a segment is (first sequence, every source's draws before it, weights). The
schedule's (--data-weight-schedule) changes start a new segment at the step they name; so does a resume
with other --data-weights (the position in each source is kept). The segments (one per change: a handful)
are the loader's state beside the position, so a resume, on any world size, continues exactly.
"""

from __future__ import annotations

import bisect
import math
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpt2.core.config import EOT_TOKEN, GPT2_VOCAB_SIZE
from gpt2.core.schedule import BatchLayout
from gpt2.data.check import out_of_vocab
from gpt2.data.loader import (
    DATA_ORDERS,
    ID_BLOCK,
    EvalLoader,
    ShardSet,
    TokenStream,
    TrainLoader,
    shard_difference,
    to_device,
)
from gpt2.data.permutation import Permutation
from gpt2.data.shards import ShardError, ShardFiles, default_max_open

QUANTUM = 1 << 20
"""Weights are integers summing to this: exact arithmetic (no float rounding decides a draw), shares
within 1e-6 of the weights given."""


@dataclass(frozen=True)
class MixedShards:
    """The shards of a mixture's sources, one ShardSet each (one split), named by their directories."""

    names: tuple[str, ...]
    dirs: tuple[str, ...]
    sets: tuple[ShardSet, ...]

    @property
    def total_tokens(self) -> int:
        return sum(s.total_tokens for s in self.sets)


# ---------------------------------------------------------------------------------------------- the schedule


def quantize(weights) -> tuple[int, ...]:
    """Weights (any positive scale) as integers summing to QUANTUM, the largest remainders rounded up."""
    total = sum(weights)
    raw = [w / total * QUANTUM for w in weights]
    q = [math.floor(r) for r in raw]
    for k in sorted(range(len(q)), key=lambda k: (q[k] - raw[k], k))[: QUANTUM - sum(q)]:
        q[k] += 1
    if any(w > 0 and n == 0 for w, n in zip(weights, q)):
        raise ValueError(f"weights {list(weights)}: a share below 1/{QUANTUM} of the total is too small to draw")
    return tuple(q)


def drawn(q: tuple[int, ...], n: int) -> list[int]:
    """How many of the first n sequences of a segment with integer weights q each source gets (exact)."""
    out = [0] * len(q)

    def visit(lo: int, hi: int, n: int) -> None:
        if hi - lo == 1:
            out[lo] = n
            return
        mid = (lo + hi + 1) // 2
        left, total = sum(q[lo:mid]), sum(q[lo:hi])
        went_left = (n * left + total // 2) // total if total else 0
        visit(lo, mid, went_left)
        visit(mid, hi, n - went_left)

    visit(0, len(q), n)
    return out


def pick(q: tuple[int, ...], j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For sequences j (int64, counted from a segment's start): each one's source, and its place among that
    source's draws in the segment. drawn()'s rule, one tree level at a time, vectorised."""
    j = np.asarray(j, dtype=np.int64).reshape(-1)
    source, place = np.empty_like(j), np.empty_like(j)
    todo = [(0, len(q), np.arange(j.size), j)]
    while todo:
        lo, hi, rows, local = todo.pop()
        if not rows.size:
            continue
        if hi - lo == 1:
            source[rows], place[rows] = lo, local
            continue
        mid = (lo + hi + 1) // 2
        left, total = sum(q[lo:mid]), sum(q[lo:hi])
        before = (local * left + total // 2) // total
        go_left = ((local + 1) * left + total // 2) // total > before
        todo += [(lo, mid, rows[go_left], before[go_left]), (mid, hi, rows[~go_left], (local - before)[~go_left])]
    return source, place


@dataclass(frozen=True)
class Segment:
    """Weights from one sequence on: where they start, each source's draws before it, the weights."""

    start: int
    base: tuple[int, ...]
    weights: tuple[int, ...]


class Schedule:
    """The segments of a run: each sequence's source and place, each source's draws up to a sequence."""

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = segments

    def segment(self, i: int) -> Segment:
        return self.segments[bisect.bisect_right([s.start for s in self.segments], i) - 1]

    def drawn(self, i: int) -> list[int]:
        """Each source's sequences among global sequences [0, i)."""
        seg = self.segment(i)
        return [b + n for b, n in zip(seg.base, drawn(seg.weights, i - seg.start))]

    def pick(self, i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global sequences i -> (source, place in that source)."""
        i = np.asarray(i, dtype=np.int64)
        starts = np.array([s.start for s in self.segments])
        which = np.searchsorted(starts, i, side="right") - 1
        source, place = np.empty_like(i), np.empty_like(i)
        for n in np.unique(which):
            seg, here = self.segments[n], which == n
            source[here], local = pick(seg.weights, i[here] - seg.start)
            place[here] = local + np.asarray(seg.base)[source[here]]
        return source, place

    def change(self, i: int, weights: tuple[int, ...]) -> bool:
        """New weights from sequence i on (i at or past the last segment's start); False when they are the same."""
        last = self.segments[-1]
        if weights == last.weights:
            return False
        segment = Segment(i, tuple(self.drawn(i)), weights)
        if last.start == i:  # two changes at one place: the later one holds
            self.segments[-1] = segment
        else:
            self.segments.append(segment)
        return True


def weights_at(changes: list[tuple[int, tuple[int, ...]]], step: int) -> tuple[int, ...]:
    """The weights in effect at optimizer step `step` (changes: (step, weights) in step order, from step 0)."""
    return [w for s, w in changes if s <= step][-1]


def planned_draws(changes, rows_before, steps: int) -> list[int]:
    """Each source's sequences after `steps` optimizer steps of a fresh run (the plan and the dry run);
    rows_before(step): the sequences steps 0 .. step - 1 take."""
    changes = [(s, quantize(w)) for s, w in changes]
    schedule = Schedule([Segment(0, (0,) * len(changes[0][1]), weights_at(changes, 0))])
    for step, weights in changes:
        if 0 < step < steps:
            schedule.change(rows_before(step), weights)
    return schedule.drawn(rows_before(steps))


def describe_weights(names, weights) -> str:
    return ", ".join(f"{name} {w:.4g}" for name, w in zip(names, weights))


# ---------------------------------------------------------------------------------------------- the loader


class SourceWindows:
    """One source of a mixture as the loader reads it: its windows, in its own order, epoch after epoch."""

    def __init__(self, name: str, shards: ShardSet, *, seed: int, order: str, seq_len: int, max_open: int) -> None:
        if shards.total_tokens < seq_len + 1:
            raise ShardError(
                f"source {name}: its train shards hold {shards.total_tokens:,} tokens, fewer than one sequence of "
                f"block_size {seq_len} needs ({seq_len + 1}); add data to it or leave it out of --data-dir"
            )
        self.name, self.shards, self.order, self.T = name, shards, order, seq_len
        self.key = (seed << 32) | zlib.crc32(name.encode())  # its own orders: --seed and its name
        self.files = ShardFiles(shards.paths, shards.sizes, max_open)
        self.windows = TokenStream(shards, seed=self.key, shuffle=False, files=self.files)
        self.stream = TokenStream(shards, seed=self.key, shuffle=True, files=self.files)
        self.n_windows = (shards.total_tokens - 1) // seq_len
        self._perm: Permutation | None = None
        self._perm_epoch = -1

    def epoch(self, place: int) -> int:
        """The epoch (from 0) of its place `place`."""
        if self.order == "sequential":
            return place * self.T // self.shards.total_tokens
        return place // self.n_windows

    def epochs(self, n: int) -> float:
        """Passes over its train split that n sequences make."""
        return n * self.T / self.shards.total_tokens if self.order == "sequential" else n / self.n_windows

    def window_ids(self, places: np.ndarray) -> np.ndarray:
        """Shuffled: the windows at these places of its order (per-epoch permutations); sequential: the places."""
        if self.order == "sequential":
            return places
        epoch, j = divmod(places, self.n_windows)
        out = np.empty_like(places)
        for e in np.unique(epoch):
            if self._perm_epoch != e:
                self._perm = Permutation(self.n_windows, seed=self.key, epoch=int(e))
                self._perm_epoch = e
            out[epoch == e] = self._perm(j[epoch == e])
        return out

    def read(self, ids: np.ndarray, pool: ThreadPoolExecutor) -> np.ndarray:
        """Windows ids (window_ids'), T + 1 tokens each, as int64 rows."""
        if self.order == "sequential":
            return np.stack([self.stream.read(int(i) * self.T, self.T + 1) for i in ids])
        return self.windows.read_rows((ids * self.T).tolist(), self.T + 1, pool=pool)

    def locate(self, window: int, column: int) -> tuple[Path, int]:
        stream = self.stream if self.order == "sequential" else self.windows
        return stream.locate(window * self.T + column)


class MixtureLoader:
    """This rank's micro-batches of each optimizer step, each sequence from the source the schedule says
    (the module docstring). The trainer's loader interface, as TrainLoader's, plus at_step (the weights
    of a step), news (lines for the log) and source_numbers (metrics)."""

    def __init__(
        self,
        mixed: MixedShards,
        layout: BatchLayout,
        *,
        changes: list[tuple[int, tuple[float, ...]]],
        rank: int,
        seed: int,
        device: torch.device,
        pin_memory: bool = True,
        order: str = "shuffled",
        defer_bad_tokens: bool = False,
    ) -> None:
        if order not in DATA_ORDERS:
            raise ValueError(f"data order {order!r} must be one of {DATA_ORDERS}")
        self.accum_steps = layout.accum_steps
        self.B, self.T, self.G = layout.micro_batch_size, layout.seq_len, layout.total_batch_size
        self.rank, self.world_size = rank, layout.world_size
        self.seed, self.device, self.pin, self.order = seed, device, pin_memory, order
        per_source = max(1, default_max_open() // len(mixed.sets))  # the descriptor budget, shared
        self.names = mixed.names
        self.sources = [
            SourceWindows(name, shards, seed=seed, order=order, seq_len=self.T, max_open=per_source)
            for name, shards in zip(mixed.names, mixed.sets)
        ]
        self.changes = [(step, quantize(w)) for step, w in changes]
        self.schedule = Schedule([Segment(0, (0,) * len(self.sources), weights_at(self.changes, 0))])
        self.position = 0
        self.defer_bad_tokens = defer_bad_tokens
        self.problem: str | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._block: tuple[int, int, np.ndarray, np.ndarray] | None = None  # (version, first place, sources, ids)
        self._version = 0  # moves when the segments change: a block worked out ahead is then void
        self._news: list[str] = []
        self._epochs_begun: list[tuple[int, int]] = []
        self._resumed = False

    # -- what the trainer reads

    def micro_batch(self, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of shape (B, T) for one micro-step of the current optimizer step."""
        first = self.position // self.T + (micro_step * self.world_size + self.rank) * self.B
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="gpt2-rows")
        sources, ids = self.micro_batch_windows(first)
        rows = np.empty((self.B, self.T + 1), dtype=np.int64)
        for k in np.unique(sources):
            here = sources == k
            rows[here] = self.sources[k].read(ids[here], self._pool)
        if rows.max() >= GPT2_VOCAB_SIZE:
            rows = self._out_of_vocab(rows, sources, ids)
        x, y = rows[:, :-1].copy(), rows[:, 1:].copy()
        return to_device(x, self.device, self.pin), to_device(y, self.device, self.pin)

    def _out_of_vocab(self, rows: np.ndarray, sources: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """TrainLoader._out_of_vocab's rule: the shard, offset and id named; raised, or kept for the trainer."""
        row, col = (int(i) for i in np.argwhere(rows >= GPT2_VOCAB_SIZE)[0])
        path, offset = self.sources[int(sources[row])].locate(int(ids[row]), col)
        problem = out_of_vocab(path, offset, int(rows[row, col]))
        if not self.defer_bad_tokens:
            raise ShardError(problem)
        self.problem = self.problem or problem
        return np.where(rows >= GPT2_VOCAB_SIZE, EOT_TOKEN, rows)

    def windows_at(self, places: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Global sequences -> (source, window id in it: shuffled, its window; sequential, its place)."""
        sources, place = self.schedule.pick(places)
        ids = np.empty_like(place)
        for k in np.unique(sources):
            ids[sources == k] = self.sources[k].window_ids(place[sources == k])
        return sources, ids

    def micro_batch_windows(self, first: int) -> tuple[np.ndarray, np.ndarray]:
        """windows_at of sequences first .. first + B - 1, from a block of this rank's next micro-batches
        worked out at once (TrainLoader.micro_batch_windows says why); void when the weights change."""
        stride = self.world_size * self.B
        if self._block is not None and self._block[0] == self._version:
            _, base, sources, ids = self._block
            j, off = divmod(first - base, stride)
            if off == 0 and 0 <= j < len(sources):
                return sources[j], ids[j]
        rows = max(1, ID_BLOCK // self.B)
        places = first + stride * np.arange(rows)[:, None] + np.arange(self.B)[None, :]
        sources, ids = self.windows_at(places.reshape(-1))
        self._block = (self._version, first, sources.reshape(rows, self.B), ids.reshape(rows, self.B))
        return self._block[2][0], self._block[3][0]

    def windows_of(self, micro_step: int) -> list[str]:
        """source:window of each row micro_batch(micro_step) reads (train_ddp.py --dry-run)."""
        first = self.position // self.T + (micro_step * self.world_size + self.rank) * self.B
        sources, ids = self.windows_at(np.arange(first, first + self.B))
        return [f"{self.names[k]}:{i}" for k, i in zip(sources.tolist(), ids.tolist())]

    def drawn(self) -> list[int]:
        """Each source's sequences drawn up to the current position."""
        return self.schedule.drawn(self.position // self.T)

    def source_numbers(self) -> dict:
        """tokens/NAME (training tokens drawn from it so far) and epochs/NAME (passes over it) for metrics."""
        out = {}
        for source, n in zip(self.sources, self.drawn()):
            out[f"tokens/{source.name}"] = n * self.T
            out[f"epochs/{source.name}"] = round(source.epochs(n), 6)
        return out

    # -- moving on

    def advance(self, tokens: int | None = None) -> None:
        """Move to the next optimizer step's global batch, past `tokens` (default: a whole step's, as
        TrainLoader.advance); remember the epochs that began in this one."""
        before = self.drawn()
        self.position += self.G if tokens is None else tokens
        for k, (source, n0, n1) in enumerate(zip(self.sources, before, self.drawn())):
            if n1 > n0 and source.epoch(n1 - 1) > source.epoch(max(n0 - 1, 0)):
                self._epochs_begun.append((k, source.epoch(n1 - 1)))

    def at_step(self, step: int) -> None:
        """Before optimizer step `step` (0-based, the steps done): its weights (the schedule's, from this run's
        flags) in effect from the current position; a change, and the epochs begun, kept as news."""
        for k, epoch in self._epochs_begun:
            source = self.sources[k]
            self._news.append(
                f"data       step {step}: source {source.name} ran out; its epoch {epoch + 1} began"
                + (" (its windows in a new order)" if self.order == "shuffled" else "")
            )
        self._epochs_begun = []
        old = self.schedule.segments[-1].weights
        weights = weights_at(self.changes, step)
        if self.schedule.change(self.position // self.T, weights):
            self._version += 1
            shares = [w / QUANTUM for w in weights]
            if self._resumed:
                self._news.append(
                    f"resume: mixture weights {describe_weights(self.names, [w / QUANTUM for w in old])} -> "
                    f"{describe_weights(self.names, shares)} from step {step} (the position in each source is kept)"
                )
            else:
                self._news.append(
                    f"data       after step {step}: mixture weights now {describe_weights(self.names, shares)}"
                )
        self._resumed = False

    def news(self) -> list[str]:
        """Lines for the log since the last call (the same on every rank)."""
        out, self._news = self._news, []
        return out

    # -- state

    def state_dict(self) -> dict:
        return {
            "position": self.position,
            "seed": self.seed,
            "order": self.order,
            "sources": [[s.name, s.shards.fingerprint()] for s in self.sources],
            "segments": [[s.start, list(s.base), list(s.weights)] for s in self.schedule.segments],
        }

    def load_state_dict(self, state: dict) -> None:
        """A mixture checkpoint of these sources (by name, in this order, the same shards), seed and order."""
        names = list(self.names)
        if "sources" not in state:
            raise ValueError(
                f"the checkpoint was trained on one source, this run mixes {', '.join(names)}: pass its --data-dir "
                "alone to resume it, or start fresh with --resume never"
            )
        saved = [name for name, _ in state["sources"]]
        if saved != names:
            fix = (
                f"pass --data-dir in its order ({', '.join(saved)})"
                if sorted(saved) == sorted(names)
                else "pass its --data-dir directories"
            )
            raise ValueError(
                f"the checkpoint mixed the sources {', '.join(saved)}, this run names {', '.join(names)}: {fix} to "
                "resume it, or start fresh with --resume never"
            )
        for source, (name, fingerprint) in zip(self.sources, state["sources"]):
            if fingerprint != source.shards.fingerprint():
                differ = shard_difference(fingerprint, source.shards.fingerprint())
                raise ValueError(
                    f"source {name}'s train shards differ from the ones this checkpoint was trained on ({differ}); "
                    "point --data-dir at the original data, or start fresh with --resume never"
                )
        if state["seed"] != self.seed:
            raise ValueError(
                f"the checkpoint's data order used seed {state['seed']}, this run has "
                f"--seed {self.seed}; keep the seed to resume exactly"
            )
        if state["order"] != self.order:
            raise ValueError(
                f"the checkpoint was trained with --data-order {state['order']}, this run asks for "
                f"{self.order}; pass --data-order {state['order']} to resume exactly, or start fresh "
                "with --resume never"
            )
        self.position = int(state["position"])
        here = self.position // self.T
        segments = [Segment(int(s), tuple(b), tuple(w)) for s, b, w in state["segments"]]
        self.schedule = Schedule([s for s in segments if s.start <= here])  # a rewind (spike guard) drops later ones
        self._version += 1
        self._epochs_begun = []
        self._resumed = True

    # -- files

    def close(self) -> None:
        """Close every source's shard files and stop the read threads (also done when garbage-collected)."""
        for source in self.sources:
            source.files.close()
        if self._pool is not None:
            self._pool.shutdown()

    def __enter__(self) -> MixtureLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MixtureEval:
    """Each source's fixed validation set (an EvalLoader each: its first --eval-tokens), and the weights of
    their mean: val_loss = sum of weight x val_loss/NAME, --data-weights normalised (docs/data.md)."""

    def __init__(self, mixed: MixedShards, weights: tuple[float, ...], **kwargs) -> None:
        self.loaders = {name: EvalLoader(shards, **kwargs) for name, shards in zip(mixed.names, mixed.sets)}
        self.weights = dict(zip(mixed.names, weights))

    @property
    def tokens(self) -> int:
        return sum(loader.tokens for loader in self.loaders.values())

    @property
    def clamped(self) -> list[str]:
        """The sources whose val shards hold fewer than --eval-tokens."""
        return [name for name, loader in self.loaders.items() if loader.clamped]

    def mean(self, losses: dict[str, float]) -> float:
        return sum(self.weights[name] * loss for name, loss in losses.items())

    def close(self) -> None:
        for loader in self.loaders.values():
            loader.close()


def train_loader(shards: ShardSet | MixedShards, layout: BatchLayout, *, changes, **kwargs):
    """The run's train loader: TrainLoader for one source (today's, unchanged), MixtureLoader for several."""
    if isinstance(shards, MixedShards):
        return MixtureLoader(shards, layout, changes=changes, **kwargs)
    return TrainLoader(shards, layout, **kwargs)


def eval_loader(shards: ShardSet | MixedShards, weights: tuple[float, ...], **kwargs):
    """The run's validation: an EvalLoader for one source, a MixtureEval for several."""
    if isinstance(shards, MixedShards):
        return MixtureEval(shards, weights, **kwargs)
    return EvalLoader(shards, **kwargs)
