"""Rank-aware loading of token shards.

The train tokens are read as windows of seq_len + 1 tokens at stride seq_len (the extra token is
the last target). Optimizer step s takes windows [s*R, (s+1)*R) of the data order (R = global
batch tokens / seq_len); inside them, micro-step m of rank r takes rows (m*world + r)*B ... +B. So
the global batches depend only on the seed, the order and the global batch, never on the world
size or the accumulation steps (2 ranks x accum 2 see exactly what 1 rank x accum 4 sees), ranks
read disjoint rows, and the loader's whole state is one number: the position (windows consumed
times seq_len).

Two data orders (--data-order):
  shuffled (default): window w is tokens [w*T, w*T + T + 1) of the shards concatenated in name
      order, and epoch e visits every window exactly once in the order of a Permutation drawn
      from (seed, e) (gpt2/data/permutation.py: O(1) memory, whatever the corpus size). The rows of a
      batch come from all over the corpus, as nanoGPT's random windows do, but without
      replacement. Real corpora are ordered (books, code by path, Wikipedia by title): a batch of
      contiguous text comes from one or two documents and step after step walks the corpus in
      order, which learns measurably worse per token (bench/data_order.py, bench/README.md).
  sequential: the stream of the shards concatenated, their order reshuffled each epoch, read in
      order: consecutive windows. For corpora that are shuffled already (FineWeb), and the order
      checkpoints written before data orders existed resume with.
"""

from __future__ import annotations

import bisect
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpt2.core.config import EOT_TOKEN, GPT2_VOCAB_SIZE
from gpt2.core.schedule import BatchLayout
from gpt2.data.check import out_of_vocab, repair_hint
from gpt2.data.permutation import Permutation
from gpt2.data.shards import TOKEN_DTYPE, ShardError, ShardFiles, read_header

DATA_ORDERS = ("shuffled", "sequential")
ID_BLOCK = 4096
"""Shuffled window ids worked out at once, ahead of the micro-batches that read them (32 KiB)."""


@dataclass(frozen=True)
class ShardSet:
    paths: tuple[Path, ...]
    sizes: tuple[int, ...]

    @property
    def total_tokens(self) -> int:
        return sum(self.sizes)

    def fingerprint(self) -> list[list]:
        return [[p.name, n] for p, n in zip(self.paths, self.sizes)]


def shard_difference(saved: list, found: list) -> str:
    """How two shard fingerprints ([name, tokens] each) differ, in words: the first shard that differs."""
    if len(saved) != len(found):
        return f"saved {len(saved)} shard(s), found {len(found)}"
    for (name, tokens), (now_name, now_tokens) in zip(saved, found):
        if name != now_name:
            return f"saved {name}, found {now_name} in its place"
        if tokens != now_tokens:
            return f"{name}: saved with {tokens:,} tokens, now {now_tokens:,}"
    return "the same names and sizes, another order"


def find_shards(data_dir: str | Path, split: str) -> ShardSet:
    """All *{split}*.bin shards in data_dir, sorted by name, each header validated.

    Raises ShardError naming the directory or the bad file, before any training starts.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        what = "a file, not a directory of shards" if data_dir.exists() else "no such directory"
        raise ShardError(
            f"--data-dir {data_dir}: {what}; prepare one with `python -m data_prep --source FILES --out DIR`"
        )
    paths = sorted(p for p in data_dir.glob(f"*{split}*.bin") if p.is_file())
    if not paths:
        how = (
            "prepare a val split with data_prep's --val-tokens N (N tokens of whole documents held out)"
            if split == "val"
            else "prepare them with `python -m data_prep --source FILES --out DIR`"
        )
        raise ShardError(f"--data-dir {data_dir}: no *{split}*.bin shards; {how}")
    sizes = []
    for p in paths:
        try:
            n = read_header(p)
        except ShardError as e:  # a damaged shard of a data_prep run: how to find the others and repair them
            raise ShardError(f"{e}{repair_hint(data_dir, p.name)}") from None
        if n == 0:
            raise ShardError(f"{p}: shard holds no tokens; delete it or re-run data_prep")
        sizes.append(n)
    return ShardSet(tuple(paths), tuple(sizes))


class TokenStream:
    """Random access into the shards concatenated, epoch after epoch.

    With shuffle, epoch e visits the shards in a permutation drawn from (seed, e). Reads go through
    `files` (kept descriptors, gpt2/data/shards.py ShardFiles), which streams over the same shards share.
    """

    def __init__(self, shards: ShardSet, *, seed: int, shuffle: bool, files: ShardFiles | None = None) -> None:
        self.shards, self.seed, self.shuffle = shards, seed, shuffle
        self.files = files if files is not None else ShardFiles(shards.paths, shards.sizes)
        self._epoch, self._order, self._starts = -1, None, None

    def _layout(self, epoch: int) -> tuple[np.ndarray, list[int]]:
        if epoch != self._epoch:
            n = len(self.shards.paths)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            starts = np.concatenate([[0], np.cumsum([self.shards.sizes[i] for i in order])]).tolist()
            self._epoch, self._order, self._starts = epoch, order, starts
        return self._order, self._starts

    def locate(self, position: int) -> tuple[Path, int]:
        """The shard and token offset in it of stream position `position` (to name a bad token)."""
        epoch, offset = divmod(position, self.shards.total_tokens)
        order, starts = self._layout(epoch)
        k = bisect.bisect_right(starts, offset) - 1
        return self.shards.paths[int(order[k])], offset - starts[k]

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens at stream positions [start, start + n) as int64."""
        out = np.empty(n, dtype=TOKEN_DTYPE)
        filled, epoch_len = 0, self.shards.total_tokens
        while filled < n:
            epoch, offset = divmod(start + filled, epoch_len)
            order, starts = self._layout(epoch)
            k = bisect.bisect_right(starts, offset) - 1
            shard = int(order[k])
            begin = offset - starts[k]
            take = min(n - filled, self.shards.sizes[shard] - begin)
            fd = self.files.acquire([shard])[shard]
            self.files.read_into(fd, shard, begin, out[filled : filled + take])
            filled += take
        return out.astype(np.int64)

    def read_rows(self, starts: list[int], n: int, pool: ThreadPoolExecutor | None = None) -> np.ndarray:
        """Rows [s, s + n) of epoch 0's stream for each start s, as int64 (len(starts), n).

        Each row is one os.pread (two where it crosses a shard). With a pool they run in parallel:
        pread releases the GIL, so a cold page cache is read with many requests in flight instead
        of one random read after another (a memmap copy faults while holding the GIL).
        """
        order, starts_of = self._layout(0)
        by_shard: dict[int, list[tuple[int, int, int, int]]] = {}  # shard -> (row, column, begin, take)
        for row, start in enumerate(starts):
            filled = 0
            while filled < n:
                k = bisect.bisect_right(starts_of, start + filled) - 1
                shard, begin = int(order[k]), start + filled - starts_of[k]
                take = min(n - filled, self.shards.sizes[shard] - begin)
                by_shard.setdefault(shard, []).append((row, filled, begin, take))
                filled += take
        out = np.empty((len(starts), n), dtype=TOKEN_DTYPE)
        shards = list(by_shard)
        # In groups the descriptor cache can hold at once: it opens and closes only between groups,
        # in this thread, so no read in flight ever sees its descriptor closed.
        for i in range(0, len(shards), self.files.max_open):
            fds = self.files.acquire(shards[i : i + self.files.max_open])

            def fetch(piece, fds=fds) -> None:  # called within this iteration: fds is this group's
                shard, (row, column, begin, take) = piece
                self.files.read_into(fds[shard], shard, begin, out[row, column : column + take])

            def cached(piece, fds=fds) -> bool:  # read it here if no disk must be waited for
                shard, (row, column, begin, take) = piece
                return self.files.read_cached(fds[shard], begin, take, out[row, column : column + take])

            pieces = [(shard, p) for shard in fds for p in by_shard[shard]]
            if pool is None:
                for piece in pieces:
                    fetch(piece)
                continue
            # The rows in the page cache are read here, one syscall each; only those that would wait on
            # a disk go to the pool, whose hand-offs cost the host ~30 us a row (before, a warm cache's
            # every row took that trip, every micro-step: bench/step_overhead.py).
            missed = [piece for piece in pieces if not cached(piece)]
            if missed:
                list(pool.map(fetch, missed))
        return out.astype(np.int64)


def to_device(x: np.ndarray, device: torch.device, pin: bool) -> torch.Tensor:
    t = torch.from_numpy(x)
    if device.type == "cuda":
        if pin:
            return t.pin_memory().to(device, non_blocking=True)
        return t.to(device)
    return t


class TrainLoader:
    """This rank's micro-batches of each optimizer step (the module docstring has the layout)."""

    def __init__(
        self,
        shards: ShardSet,
        layout: BatchLayout,
        *,
        rank: int,
        seed: int,
        device: torch.device,
        pin_memory: bool = True,
        order: str = "shuffled",
        max_open_shards: int | None = None,
        defer_bad_tokens: bool = False,
    ) -> None:
        accum_steps = layout.accum_steps
        micro_batch_size, seq_len, total_batch_size = layout.micro_batch_size, layout.seq_len, layout.total_batch_size
        world_size = layout.world_size
        if order not in DATA_ORDERS:
            raise ValueError(f"data order {order!r} must be one of {DATA_ORDERS}")
        if shards.total_tokens < total_batch_size + 1:
            raise ShardError(
                f"the train shards hold {shards.total_tokens} tokens, fewer than one optimizer "
                f"step needs ({total_batch_size + 1}); lower --total-batch-size or add data"
            )
        self.shards, self.order = shards, order
        self.files = ShardFiles(shards.paths, shards.sizes, max_open_shards)  # close() closes them
        self.stream = TokenStream(
            shards, seed=seed, shuffle=True, files=self.files
        )  # sequential: shard order per epoch
        self.windows = TokenStream(shards, seed=seed, shuffle=False, files=self.files)  # shuffled: fixed shard order
        self.n_windows = (shards.total_tokens - 1) // seq_len
        self._perm: Permutation | None = None  # the current epoch's order, and that epoch
        self._perm_epoch = -1
        self._pool: ThreadPoolExecutor | None = None  # made on first use: shuffled rows are read in parallel
        self._id_block: tuple[int, np.ndarray] | None = None  # micro_batch_windows' (first place, ids ahead)
        self.B, self.T, self.G = micro_batch_size, seq_len, total_batch_size
        self.rank, self.world_size = rank, world_size
        self.accum_steps = accum_steps
        self.seed, self.device, self.pin = seed, device, pin_memory
        self.position = 0
        self.defer_bad_tokens = defer_bad_tokens
        self.problem: str | None = None
        """The first token id outside the vocabulary met (defer_bad_tokens), for the trainer to stop on."""

    def micro_batch(self, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of shape (B, T) for one micro-step of the current optimizer step."""
        first_seq = (micro_step * self.world_size + self.rank) * self.B
        if self.order == "sequential":
            span = self.stream.read(self.position + first_seq * self.T, self.B * self.T + 1)
            rows = np.lib.stride_tricks.sliding_window_view(span, self.T + 1)[:: self.T]
        else:
            first = self.position // self.T + first_seq
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="gpt2-rows")
            ids = self.micro_batch_windows(first)
            rows = self.windows.read_rows((ids * self.T).tolist(), self.T + 1, pool=self._pool)
        if rows.max() >= GPT2_VOCAB_SIZE:
            rows = self._out_of_vocab(rows, micro_step)
        x, y = rows[:, :-1].copy(), rows[:, 1:].copy()
        return to_device(x, self.device, self.pin), to_device(y, self.device, self.pin)

    def _out_of_vocab(self, rows: np.ndarray, micro_step: int) -> np.ndarray:
        """A batch holding an id the model cannot embed (one max over B x (T+1) int64 on the CPU per
        micro-batch, before any copy to the device: ~10 us for 64 x 1025, against a step's milliseconds).
        Without defer_bad_tokens: ShardError naming the shard, offset and id. With it (the trainer):
        the message is kept in self.problem and the batch's bad ids become EOT, so this rank's forward
        runs like every other rank's and the step's all-reduce tells every rank to stop alike."""
        row, col = (int(i) for i in np.argwhere(rows >= GPT2_VOCAB_SIZE)[0])
        first_seq = (micro_step * self.world_size + self.rank) * self.B
        if self.order == "sequential":
            path, offset = self.stream.locate(self.position + (first_seq + row) * self.T + col)
        else:
            window = int(self.window_ids(np.array([self.position // self.T + first_seq + row]))[0])
            path, offset = self.windows.locate(window * self.T + col)
        problem = out_of_vocab(path, offset, int(rows[row, col]))
        if not self.defer_bad_tokens:
            raise ShardError(problem)
        self.problem = self.problem or problem
        return np.where(rows >= GPT2_VOCAB_SIZE, EOT_TOKEN, rows)

    def windows_of(self, micro_step: int) -> np.ndarray:
        """The windows (of T + 1 tokens at stride T) micro_batch(micro_step) reads, without reading them:
        window w is tokens [w*T, w*T + T + 1) of the shards concatenated in name order (shuffled), or
        of the stream of epochs, each in its own shard order (sequential). For train_ddp.py --dry-run."""
        first_seq = (micro_step * self.world_size + self.rank) * self.B
        places = np.arange(self.position // self.T + first_seq, self.position // self.T + first_seq + self.B)
        return places if self.order == "sequential" else self.window_ids(places)

    def window_ids(self, k: np.ndarray) -> np.ndarray:
        """The windows at places k of the shuffled order (k counts on across epochs)."""
        epoch, j = divmod(k, self.n_windows)
        out = np.empty_like(k)
        for e in np.unique(epoch):  # a batch can straddle an epoch boundary
            if self._perm_epoch != e:
                self._perm, self._perm_epoch = Permutation(self.n_windows, seed=self.seed, epoch=int(e)), e
            out[epoch == e] = self._perm(j[epoch == e])
        return out

    def micro_batch_windows(self, first: int) -> np.ndarray:
        """window_ids of places first .. first + B - 1 (a micro-batch's rows), read from a block worked
        out ahead. This rank's micro-batches start world_size * B places apart, step after step (a
        step is accum_steps * world_size * B places), so the next ID_BLOCK // B of them are one
        vectorised window_ids call: the permutation's ~50 small numpy operations cost ~0.7 ms per
        call whatever its length, on the host, every micro-step (bench/step_overhead.py). A start off
        the block (a resume, another rank's layout) works out a new one: the ids depend on the
        place alone."""
        stride = self.world_size * self.B
        if self._id_block is not None:
            base, block = self._id_block
            j, off = divmod(first - base, stride)
            if off == 0 and 0 <= j < len(block):
                return block[j]
        rows = max(1, ID_BLOCK // self.B)
        places = first + stride * np.arange(rows)[:, None] + np.arange(self.B)[None, :]
        block = self.window_ids(places.reshape(-1)).reshape(rows, self.B)
        self._id_block = (first, block)
        return block[0]

    def advance(self, tokens: int | None = None) -> None:
        """Move to the next optimizer step's global batch, past `tokens` (default: a whole step's; a batch
        warmup's smaller step took the first micro-steps of the full one's rows, gpt2/core/schedule.py)."""
        self.position += self.G if tokens is None else tokens

    def close(self) -> None:
        """Close the shard files and stop the read threads (also done when garbage-collected)."""
        self.files.close()
        if self._pool is not None:
            self._pool.shutdown()

    def __enter__(self) -> TrainLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "shards": self.shards.fingerprint(), "order": self.order}

    def load_state_dict(self, state: dict) -> None:
        """Resume the order the checkpoint was written with: checkpoints from before data orders
        existed (no "order") read the stream sequentially, and go on doing so."""
        if "sources" in state:  # gpt2/data/mixture.py MixtureLoader's
            names = ", ".join(name for name, _ in state["sources"])
            raise ValueError(
                f"the checkpoint was trained on a mixture of {names}, this run reads one --data-dir: pass the "
                "checkpoint's --data-dir and --data-weights to resume it, or start fresh with --resume never"
            )
        if state["shards"] != self.shards.fingerprint():
            differ = shard_difference(state["shards"], self.shards.fingerprint())
            raise ValueError(
                f"the train shards differ from the ones this checkpoint was trained on ({differ}); "
                "point --data-dir at the original data, or start fresh with --resume never"
            )
        if state["seed"] != self.seed:
            raise ValueError(
                f"the checkpoint's data order used seed {state['seed']}, this run has "
                f"--seed {self.seed}; keep the seed to resume exactly"
            )
        saved = state.get("order", "sequential")
        if "order" in state and saved != self.order:
            raise ValueError(
                f"the checkpoint was trained with --data-order {saved}, this run asks for "
                f"{self.order}; pass --data-order {saved} to resume exactly, or start fresh "
                "with --resume never"
            )
        self.order = saved
        self.position = int(state["position"])


class EvalLoader:
    """A fixed validation set: the first eval_tokens of the val stream, as full sequences.

    Rank r evaluates sequences r, r+W, r+2W, ... in micro-batches of B; a short last batch is padded
    with ignored targets (-1) so shapes stay fixed (no recompiles), and every rank yields len(self)
    batches. Sum of losses and token counts
    are reduced over ranks, so the result does not depend on the world size.
    """

    def __init__(
        self,
        shards: ShardSet,
        *,
        micro_batch_size: int,
        seq_len: int,
        eval_tokens: int,
        rank: int,
        world_size: int,
        device: torch.device,
        pin_memory: bool = True,
        max_open_shards: int | None = None,
    ) -> None:
        self.stream = TokenStream(
            shards, seed=0, shuffle=False, files=ShardFiles(shards.paths, shards.sizes, max_open_shards)
        )
        available = (shards.total_tokens - 1) // seq_len
        self.n_seqs = min(eval_tokens // seq_len, available)
        self.clamped = eval_tokens // seq_len > available
        self.B, self.T, self.rank, self.world_size = micro_batch_size, seq_len, rank, world_size
        self.device, self.pin = device, pin_memory

    @property
    def tokens(self) -> int:
        return self.n_seqs * self.T

    def close(self) -> None:
        """Close the shard files (also done when garbage-collected)."""
        self.stream.files.close()

    def __enter__(self) -> EvalLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        """Micro-batches per rank, the same on every rank: a rank with one sequence fewer may get a
        last batch of padding only (targets all -1). Under FSDP every forward is a collective, so no
        rank may finish the evaluation a batch before the others."""
        most = -(-self.n_seqs // self.world_size)  # sequences of the ranks with the most
        return -(-most // self.B)

    def __iter__(self):
        mine = list(range(self.rank, self.n_seqs, self.world_size))
        for i in range(0, len(self) * self.B, self.B):
            seqs = mine[i : i + self.B]
            x = np.zeros((self.B, self.T), dtype=np.int64)
            y = np.full((self.B, self.T), -1, dtype=np.int64)
            for row, s in enumerate(seqs):
                span = self.stream.read(s * self.T, self.T + 1)
                x[row], y[row] = span[:-1], span[1:]
            yield to_device(x, self.device, self.pin), to_device(y, self.device, self.pin)
