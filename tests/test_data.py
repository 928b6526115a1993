import numpy as np
import pytest
import torch

from gpt2.core.schedule import BatchLayout
from gpt2.data.loader import EvalLoader, TokenStream, TrainLoader, find_shards
from gpt2.data.shards import HEADER_BYTES, ShardError, make_header, write_shard

CPU = torch.device("cpu")


@pytest.fixture
def shard_dir(tmp_path):
    """Three train shards of distinct sizes whose tokens encode their stream position."""
    sizes = [1000, 1700, 1300]
    start = 0
    for i, n in enumerate(sizes):
        write_shard(tmp_path / f"train_{i:06d}.bin", (np.arange(start, start + n) % 50000).astype(np.uint16))
        start += n
    write_shard(tmp_path / "val_000000.bin", np.arange(900, dtype=np.uint16))
    return tmp_path


def loader(shards, world, rank, B=2, T=16, G=256, seed=7, order="shuffled"):
    return TrainLoader(shards, BatchLayout(B, T, G, world), rank=rank, seed=seed, device=CPU, order=order)


def global_batches(shards, world, steps=12, B=2, T=16, G=256, order="shuffled"):
    """Each step's sequences in global order: (micro_step*world + rank) ordering."""
    loaders = [loader(shards, world, r, B, T, G, order=order) for r in range(world)]
    out = []
    for _ in range(steps):
        seqs = {}
        for r, ld in enumerate(loaders):
            for m in range(ld.accum_steps):
                x, y = ld.micro_batch(m)
                seqs[m * world + r] = (x, y)
            ld.advance()
        out.append(torch.cat([seqs[k][0] for k in sorted(seqs)]))
    return out


ORDERS = pytest.mark.parametrize("order", ["shuffled", "sequential"])


@ORDERS
def test_global_batches_do_not_depend_on_world_size(shard_dir, order):
    shards = find_shards(shard_dir, "train")
    one = global_batches(shards, 1, order=order)  # 1 rank x accum 8
    two = global_batches(shards, 2, order=order)  # 2 ranks x accum 4
    four = global_batches(shards, 4, order=order)  # 4 ranks x accum 2
    for a, b, c in zip(one, two, four):
        assert torch.equal(a, b) and torch.equal(a, c)


def window_ids(shards, world, steps, *, B=1, T=16, G=96, order="shuffled"):
    """The window (first token // T: the fixture's tokens are their positions) of every row, in global order."""
    return [int(row[0]) // T for batch in global_batches(shards, world, steps, B, T, G, order) for row in batch]


@pytest.mark.parametrize("world", [1, 2, 3])  # accumulation 6, 3 and 2 micro-steps
def test_shuffled_visits_every_window_once_per_epoch_in_a_new_order(shard_dir, world):
    shards = find_shards(shard_dir, "train")
    n = (shards.total_tokens - 1) // 16  # 249 windows of 17 tokens at stride 16
    seen = window_ids(shards, world, steps=84)  # 504 rows: two epochs and a bit
    first, second = seen[:n], seen[n : 2 * n]
    assert sorted(first) == sorted(second) == list(range(n))  # without replacement, crossing shards
    assert first != second  # each epoch its own order
    assert first != sorted(first)  # and not the stream order
    assert seen == window_ids(shards, 1, steps=84)  # the same rows whatever the world size


def test_sequential_reads_consecutive_windows(shard_dir):
    shards = find_shards(shard_dir, "train")
    seen = window_ids(shards, 2, steps=10, order="sequential")
    first = seen[0]  # the epoch's shard order decides where the stream starts; every shard holds > 50 windows
    assert seen[:50] == list(range(first, first + 50))


@ORDERS
def test_ranks_read_disjoint_parts_and_targets_are_next_tokens(shard_dir, order):
    shards = find_shards(shard_dir, "train")
    lds = [loader(shards, 2, r, order=order) for r in range(2)]
    seen = []
    for ld in lds:
        for m in range(ld.accum_steps):
            x, y = ld.micro_batch(m)
            assert torch.equal(x[:, 1:], y[:, :-1])
            seen.extend(tuple(row.tolist()) for row in x)
    assert len(seen) == len(set(seen)) == 256 // 16  # every sequence of the global batch exactly once


def test_stream_crosses_shards_and_reshuffles_each_epoch(shard_dir):
    shards = find_shards(shard_dir, "train")
    stream = TokenStream(shards, seed=3, shuffle=True)
    order0, _ = stream._layout(0)
    order0 = order0.copy()
    order1, _ = stream._layout(1)
    assert sorted(order0) == [0, 1, 2]
    orders = {tuple(TokenStream(shards, seed=3, shuffle=True)._layout(e)[0]) for e in range(6)}
    assert len(orders) > 1  # reshuffled across epochs
    assert tuple(TokenStream(shards, seed=3, shuffle=True)._layout(0)[0]) == tuple(order0)  # deterministic
    # a read spanning every shard and the epoch boundary equals the concatenation in epoch order
    data = [np.arange(s, s + n) % 50000 for s, n in ((0, 1000), (1000, 1700), (2700, 1300))]
    epoch0 = np.concatenate([data[i] for i in order0])
    epoch1 = np.concatenate([data[i] for i in order1])
    got = stream.read(3500, 1000)
    assert np.array_equal(got, np.concatenate([epoch0, epoch1])[3500:4500])


@ORDERS
@pytest.mark.parametrize("steps", [0, 5, 31])  # 31: past the end of the first epoch
def test_state_round_trip_resumes_the_same_batches(shard_dir, order, steps):
    shards = find_shards(shard_dir, "train")
    a = loader(shards, 2, 1, order=order)
    for _ in range(steps):
        a.advance()
    state = a.state_dict()
    b = loader(shards, 2, 1, order=order)
    b.load_state_dict(state)
    for m in range(a.accum_steps):
        assert all(torch.equal(u, v) for u, v in zip(a.micro_batch(m), b.micro_batch(m)))
    # a different world size continues from the same global batch
    whole = global_batches(shards, 1, steps=steps + 2, order=order)
    c = loader(shards, 1, 0, order=order)
    c.load_state_dict(state)
    assert torch.equal(torch.cat([c.micro_batch(m)[0] for m in range(c.accum_steps)]), whole[steps])
    with pytest.raises(ValueError, match="seed"):
        loader(shards, 2, 1, seed=8, order=order).load_state_dict(state)
    other = "sequential" if order == "shuffled" else "shuffled"
    with pytest.raises(ValueError, match=f"--data-order {order}"):
        loader(shards, 2, 1, order=other).load_state_dict(state)


def test_a_checkpoint_from_before_data_orders_resumes_sequentially(shard_dir):
    shards = find_shards(shard_dir, "train")
    old = loader(shards, 2, 0, order="sequential")
    for _ in range(3):
        old.advance()
    state = {k: v for k, v in old.state_dict().items() if k != "order"}  # what the old code saved
    new = loader(shards, 2, 0)  # today's default, shuffled
    new.load_state_dict(state)
    assert new.order == "sequential"
    assert torch.equal(new.micro_batch(0)[0], old.micro_batch(0)[0])


def test_state_refuses_different_shards(shard_dir, tmp_path_factory):
    shards = find_shards(shard_dir, "train")
    state = loader(shards, 1, 0).state_dict()
    (shard_dir / "train_000002.bin").unlink()
    with pytest.raises(ValueError, match=r"differ .*\(saved 3 shard\(s\), found 2\)"):
        loader(find_shards(shard_dir, "train"), 1, 0).load_state_dict(state)


def test_other_data_of_as_many_shards_is_named_by_the_shard_that_differs():
    """Resuming onto other data of one shard said "(saved 1 shards, found 1)"."""
    from gpt2.data.loader import shard_difference

    assert shard_difference([["train_0.bin", 100]], [["train_0.bin", 90]]) == (
        "train_0.bin: saved with 100 tokens, now 90"
    )
    assert shard_difference([["a.bin", 1]], [["b.bin", 1]]) == "saved a.bin, found b.bin in its place"


def test_a_data_dir_that_is_a_file_is_named_a_file(tmp_path):
    (tmp_path / "f.bin").write_bytes(b"x")
    with pytest.raises(ShardError, match="f.bin: a file, not a directory of shards"):
        find_shards(tmp_path / "f.bin", "train")


def test_eval_loader_covers_the_first_sequences_once_whatever_the_world(shard_dir):
    shards = find_shards(shard_dir, "val")
    for world in (1, 2, 3):
        rows = []
        for r in range(world):
            ev = EvalLoader(
                shards, micro_batch_size=2, seq_len=16, eval_tokens=16 * 7, rank=r, world_size=world, device=CPU
            )
            for x, y in ev:
                assert x.shape == (2, 16)
                rows += [int(row[0]) for row, t in zip(x, y) if t[0] != -1]
        assert sorted(rows) == [16 * i for i in range(7)]
    clamped = EvalLoader(shards, micro_batch_size=2, seq_len=16, eval_tokens=10**6, rank=0, world_size=1, device=CPU)
    assert clamped.clamped and clamped.n_seqs == (900 - 1) // 16


def test_find_shards_reports_bad_files_by_name(tmp_path):
    with pytest.raises(ShardError, match="no such directory"):
        find_shards(tmp_path / "missing", "train")
    with pytest.raises(ShardError, match=r"no \*train\*\.bin"):
        find_shards(tmp_path, "train")
    write_shard(tmp_path / "train_000000.bin", np.arange(10, dtype=np.uint16))
    bad = tmp_path / "train_000001.bin"
    bad.write_bytes(b"\x00" * 2000)
    with pytest.raises(ShardError, match="train_000001.bin: bad magic"):
        find_shards(tmp_path, "train")
    header = make_header(100).tobytes()
    bad.write_bytes(header + b"\x00" * 50)
    with pytest.raises(ShardError, match="train_000001.bin: header says 100 tokens"):
        find_shards(tmp_path, "train")
    write_shard(bad, np.zeros(0, dtype=np.uint16))
    with pytest.raises(ShardError, match="train_000001.bin: shard holds no tokens"):
        find_shards(tmp_path, "train")


def test_llmc_named_shards_are_found(tmp_path):
    """llm.c / modded-nanogpt name shards fineweb_train_000001.bin; written here by hand, byte by byte."""
    tokens = np.arange(5000, dtype="<u2")
    with open(tmp_path / "fineweb_train_000001.bin", "wb") as f:
        header = np.zeros(256, dtype="<i4")
        header[0], header[1], header[2] = 20240520, 1, len(tokens)
        f.write(header.tobytes())
        f.write(tokens.tobytes())
    shards = find_shards(tmp_path, "train")
    assert shards.sizes == (5000,) and (tmp_path / "fineweb_train_000001.bin").stat().st_size == HEADER_BYTES + 10000
    assert np.array_equal(TokenStream(shards, seed=0, shuffle=False).read(0, 5000), tokens)


def test_loader_refuses_too_little_data(shard_dir):
    with pytest.raises(ShardError, match="fewer than one optimizer step"):
        loader(find_shards(shard_dir, "train"), 1, 0, B=2, T=16, G=2**13 * 16 // 16 * 2)


@pytest.mark.parametrize("n", [1, 2, 3, 97, 256, 257, 1000, 4097])  # a prime, 2^k, 2^k + 1
def test_permutation_is_a_bijection_for_small_and_awkward_n(n):
    from gpt2.data.permutation import Permutation

    for seed, epoch in ((0, 0), (7, 1)):
        out = Permutation(n, seed=seed, epoch=epoch)(np.arange(n))
        assert sorted(out.tolist()) == list(range(n))
    if n >= 97:
        a, b = Permutation(n, seed=1, epoch=0)(np.arange(n)), Permutation(n, seed=1, epoch=1)(np.arange(n))
        assert not np.array_equal(a, b)
        assert abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.3  # no visible trend with position
    with pytest.raises(IndexError):
        Permutation(n, seed=0, epoch=0)(np.array([n]))


def test_parallel_row_reads_equal_the_stream_and_cross_shards(shard_dir):
    from concurrent.futures import ThreadPoolExecutor

    shards = find_shards(shard_dir, "train")
    stream = TokenStream(shards, seed=0, shuffle=False)
    starts = [0, 990, 2690, 3000, 2000]  # 990 and 2690 cross into the next shard
    with ThreadPoolExecutor(4) as pool:
        rows = stream.read_rows(starts, 17, pool=pool)
    assert rows.dtype == np.int64
    for row, s in zip(rows, starts):
        assert np.array_equal(row, stream.read(s, 17))
        assert np.array_equal(row, np.arange(s, s + 17))  # the fixture's tokens are their positions


# Kept shard descriptors (issue 22, section 3): opening a shard per read is two metadata operations
# on a parallel file system for every shard a micro-batch touches.


def many_shards(tmp_path, n=12, size=400):
    """n train shards of `size` tokens whose tokens are their stream positions."""
    for i in range(n):
        write_shard(tmp_path / f"train_{i:06d}.bin", np.arange(i * size, (i + 1) * size, dtype=np.uint16))
    return find_shards(tmp_path, "train")


@pytest.fixture
def count_opens(monkeypatch):
    """Every open of a file (os.open, builtins.open: np.memmap's way in) as a list of paths."""
    import builtins
    import os

    opened = []
    real_os_open, real_open = os.open, builtins.open

    def os_open(path, *a, **k):
        opened.append(str(path))
        return real_os_open(path, *a, **k)

    def open_(file, *a, **k):
        opened.append(str(file))
        return real_open(file, *a, **k)

    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(builtins, "open", open_)
    return opened


def fds_into(directory) -> int:
    """This process's open descriptors on files in `directory`, as the kernel sees them."""
    import os

    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory))
        except OSError:  # the descriptor listdir itself used, closed by now
            pass
    return n


def shards_of(x: torch.Tensor, size: int) -> set[int]:
    return set((x.flatten() // size).tolist())  # the tokens are positions: shard = position // size


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
@ORDERS
def test_a_steady_run_opens_each_shard_once_and_no_file_per_step(tmp_path, count_opens, order):
    shards = many_shards(tmp_path, n=8)
    ld = loader(shards, 1, 0, B=16, T=16, G=16 * 16 * 4, order=order)  # 64 rows a step
    count_opens.clear()  # writing and validating the shards opened them
    touched, opens_per_step = set(), []
    for step in range(20):  # 1280 rows: more than five epochs of 199 windows
        before, new = len(count_opens), set()
        for m in range(ld.accum_steps):
            x, _ = ld.micro_batch(m)
            new |= shards_of(x, 400) - touched
            touched |= new
        ld.advance()
        opens_per_step.append(len(count_opens) - before)
        assert opens_per_step[-1] == len(new), (step, opens_per_step)  # an open only for a shard never read
    assert sorted(count_opens) == sorted(str(p) for p in shards.paths)  # each shard opened once, nothing else
    if order == "shuffled":  # the first step's 64 rows come from all over the corpus
        assert opens_per_step[0] == 8 and not any(opens_per_step[1:])
    assert fds_into(tmp_path) == 8
    ld.close()
    assert fds_into(tmp_path) == 0


def test_evaluating_again_opens_nothing(shard_dir, count_opens):
    ev = EvalLoader(
        find_shards(shard_dir, "val"),
        micro_batch_size=2,
        seq_len=16,
        eval_tokens=16 * 7,
        rank=0,
        world_size=1,
        device=CPU,
    )
    count_opens.clear()  # validating the shards opened them
    first = [x for x, _ in ev]
    assert len(count_opens) == 1
    assert all(torch.equal(a, b) for a, b in zip(first, [x for x, _ in ev])) and len(count_opens) == 1
    with ev:
        pass
    assert fds_into(shard_dir) == 0


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_more_shards_than_the_bound_stay_within_it_and_read_the_same_tokens(tmp_path):
    shards = many_shards(tmp_path, n=12)
    B, T, G = 16, 16, 16 * 32
    bounded = TrainLoader(shards, BatchLayout(B, T, G, 1), rank=0, seed=7, device=CPU, max_open_shards=3)
    n_windows = (shards.total_tokens - 1) // T
    for step in range(15):  # 480 rows: past the first epoch of 299 windows
        for m in range(bounded.accum_steps):
            x, y = bounded.micro_batch(m)
            assert len(shards_of(x, 400)) > 3  # each read needs more shards than stay open
            assert bounded.files.open_count <= 3 and fds_into(tmp_path) <= 3
            ids = bounded.window_ids(np.arange(step * 32 + m * B, step * 32 + (m + 1) * B))
            assert np.all(ids < n_windows)
            expected = torch.from_numpy(ids[:, None] * T + np.arange(T + 1))  # the raw tokens: positions
            assert torch.equal(x, expected[:, :-1]) and torch.equal(y, expected[:, 1:])
        bounded.advance()
    with pytest.raises(ValueError, match="at least one shard"):
        TrainLoader(shards, BatchLayout(B, T, G, 1), rank=0, seed=7, device=CPU, max_open_shards=0)


def test_the_default_bound_is_a_quarter_of_the_descriptor_limit(monkeypatch, shard_dir):
    import resource

    from gpt2.data.shards import default_max_open

    for soft, bound in ((1024, 256), (65536, 1024), (resource.RLIM_INFINITY, 1024), (3, 1)):
        monkeypatch.setattr(resource, "getrlimit", lambda which, soft=soft: (soft, resource.RLIM_INFINITY))
        assert default_max_open() == bound
    assert loader(find_shards(shard_dir, "train"), 1, 0).files.max_open == 1


def test_sequential_reads_with_one_descriptor_equal_the_unbounded_loader(tmp_path):
    shards = many_shards(tmp_path, n=12)
    a = TrainLoader(
        shards, BatchLayout(8, 16, 256, 2), rank=1, seed=7, device=CPU, order="sequential", max_open_shards=1
    )
    b = loader(shards, 2, 1, B=8, T=16, G=256, order="sequential")
    for _ in range(40):  # 10240 tokens: two epochs of 4800, each in its own shard order
        for m in range(a.accum_steps):
            assert all(torch.equal(u, v) for u, v in zip(a.micro_batch(m), b.micro_batch(m)))
        assert a.files.open_count == 1
        a.advance()
        b.advance()


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_descriptors_close_on_close_on_exit_and_when_collected(shard_dir):
    import gc

    shards = find_shards(shard_dir, "train")
    with loader(shards, 1, 0) as ld:
        ld.micro_batch(0)
        assert fds_into(shard_dir) == ld.files.open_count > 0
    assert fds_into(shard_dir) == 0
    with pytest.raises(ValueError, match="closed"):
        ld.micro_batch(0)
    ld.close()  # twice is harmless
    dropped = loader(shards, 1, 0)
    dropped.micro_batch(0)
    assert fds_into(shard_dir) > 0
    del dropped
    gc.collect()
    assert fds_into(shard_dir) == 0


def test_a_shard_changed_during_the_run_is_named(shard_dir):
    shards = find_shards(shard_dir, "train")
    write_shard(shard_dir / "train_000001.bin", np.arange(10, dtype=np.uint16))
    stream = TokenStream(shards, seed=0, shuffle=False)
    with pytest.raises(ShardError, match="train_000001.bin: now 1044 bytes, 4424 when it was validated"):
        stream.read(990, 20)


def test_the_trainer_closes_its_loaders(tmp_path, shakespeare_shards, monkeypatch):
    from _helpers import train_in_process
    from conftest import TINY_MODEL_FLAGS

    from gpt2.data.loader import EvalLoader as Eval
    from gpt2.data.loader import TrainLoader as Train
    from gpt2.distributed.group import Dist
    from gpt2.train.cli import parse_config

    closed = []
    for cls in (Train, Eval):
        monkeypatch.setattr(cls, "close", lambda self, real=cls.close: closed.append(type(self).__name__) or real(self))
    cfg = parse_config(
        [
            *TINY_MODEL_FLAGS,
            "--device",
            "cpu",
            "--compile",
            "false",
            "--dtype",
            "float32",
            "--data-dir",
            str(shakespeare_shards),
            "--out-dir",
            str(tmp_path),
            "--micro-batch-size",
            "2",
            "--total-batch-size",
            "128",
            "--max-steps",
            "2",
            "--eval-tokens",
            "256",
            "--ckpt-interval",
            "0",
            "--plot",
            "false",
        ]
    )
    assert train_in_process(cfg, Dist(rank=0, local_rank=0, world_size=1, local_world_size=1, device=CPU)) == 0
    assert sorted(closed) == ["EvalLoader", "TrainLoader"]
    assert fds_into(shakespeare_shards) == 0


def test_loader_checks_the_batch_maths_with_the_schedules_rule(shard_dir):
    """The loader asks schedule.grad_accum_steps (the one check): a ValueError naming the fix, not an assert."""
    shards = find_shards(shard_dir, "train")
    assert loader(shards, 2, 0, B=2, T=16, G=256).accum_steps == 4
    with pytest.raises(ValueError, match=r"total_batch_size=200 is not a multiple of .* = 2\*16\*2 = 64"):
        loader(shards, 2, 0, B=2, T=16, G=200)


# The host's time per micro-step (docs/performance.md, "On a GPU"): at GPT-2 124M and micro-batch 12
# the H200 waited on the host, and the loader's share was its per-call overheads.


@pytest.mark.parametrize("world,B", [(1, 2), (3, 2), (2, 5)])
def test_window_ids_worked_out_ahead_are_the_permutations_own(shard_dir, monkeypatch, world, B):
    """micro_batch_windows serves the ids from blocks computed ahead: the same ids window_ids gives
    for every place, across blocks, epoch boundaries and a jump of the position (a resume)."""
    import gpt2.data.loader as loader_mod

    monkeypatch.setattr(loader_mod, "ID_BLOCK", 7)  # blocks of a few micro-batches: many block changes
    shards = find_shards(shard_dir, "train")
    for rank in range(world):
        ld = loader(shards, world, rank, B=B, T=16, G=world * B * 16 * 2)
        fresh = loader(shards, world, rank, B=B, T=16, G=world * B * 16 * 2)
        seen = 0
        for step in range(3 * ld.n_windows // (world * B * 2) + 2):  # three epochs and more
            if step == 5:
                ld.position += ld.T  # one window on, off the stride: the block ahead must not be trusted
            for m in range(ld.accum_steps):
                first = ld.position // ld.T + (m * world + rank) * B
                got = ld.micro_batch_windows(first)
                assert np.array_equal(got, fresh.window_ids(np.arange(first, first + B))), (rank, step, m)
                seen += 1
            ld.advance()
        assert seen > 3 * 7 // B


def test_rows_the_page_cache_cannot_give_are_read_by_the_pool_alike(shard_dir, monkeypatch):
    """Rows not in the page cache (read_cached says False: here every other one, after scribbling on
    the row) are read the waiting way, by the pool: the rows equal the stream's either way."""
    from concurrent.futures import ThreadPoolExecutor

    from gpt2.data.shards import ShardFiles

    real, calls = ShardFiles.read_cached, []

    def half_cached(self, fd, begin, take, out):
        calls.append(begin)
        if len(calls) % 2:
            out[:] = 12345
            return False
        return real(self, fd, begin, take, out)

    monkeypatch.setattr(ShardFiles, "read_cached", half_cached)
    shards = find_shards(shard_dir, "train")
    stream = TokenStream(shards, seed=0, shuffle=False)
    starts = [0, 990, 2690, 3000, 2000, 17, 1500]  # 990 and 2690 cross into the next shard
    with ThreadPoolExecutor(4) as pool:
        rows = stream.read_rows(starts, 17, pool=pool)
    assert len(calls) == len(starts) + 2  # a row that crosses a shard is two reads
    for row, s in zip(rows, starts):
        assert np.array_equal(row, np.arange(s, s + 17))  # the fixture's tokens are their positions


@pytest.mark.skipif(not hasattr(__import__("os"), "RWF_NOWAIT"), reason="RWF_NOWAIT is Linux's")
def test_page_cache_reads_and_a_file_system_that_cannot_tell(shard_dir, monkeypatch):
    """read_cached reads a cached row (the fixture's shards were just written) without the pool; where
    the file system refuses RWF_NOWAIT (EOPNOTSUPP) it is asked once, and every row still arrives."""
    import errno
    import os
    from concurrent.futures import ThreadPoolExecutor

    shards = find_shards(shard_dir, "train")
    stream = TokenStream(shards, seed=0, shuffle=False)
    fd = stream.files.acquire([1])[1]
    out = np.zeros(17, dtype=np.uint16)
    assert stream.files.read_cached(fd, 5, 17, out)
    assert np.array_equal(out, np.arange(1005, 1022))

    asked = []

    def refuse(*a):
        asked.append(a)
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "preadv", refuse)
    starts = [0, 990, 2000]
    with ThreadPoolExecutor(2) as pool:
        rows = stream.read_rows(starts, 17, pool=pool)
        again = stream.read_rows(starts, 17, pool=pool)
    assert len(asked) == 1
    for r, a, s in zip(rows, again, starts):
        assert np.array_equal(r, np.arange(s, s + 17)) and np.array_equal(a, r)


@pytest.mark.skipif(not hasattr(__import__("os"), "RWF_NOWAIT"), reason="RWF_NOWAIT is Linux's")
def test_an_io_error_in_a_page_cache_read_is_left_to_the_waiting_read(shard_dir, monkeypatch):
    """EIO from the no-wait read is not "this file system cannot say": it is asked again next time, and
    the row is read the waiting way (which raises the error if it is real; here it is not)."""
    import errno
    import os
    from concurrent.futures import ThreadPoolExecutor

    stream = TokenStream(find_shards(shard_dir, "train"), seed=0, shuffle=False)
    asked = []

    def fail(*a):
        asked.append(a)
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", fail)
    with ThreadPoolExecutor(2) as pool:
        for _ in range(2):
            rows = stream.read_rows([0, 2000], 17, pool=pool)
            assert np.array_equal(rows, np.stack([np.arange(0, 17), np.arange(2000, 2017)]))
    assert len(asked) == 4
