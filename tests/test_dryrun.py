"""train_ddp.py --dry-run (gpt2/train/dryrun.py), and the rehearsal of every documented training command.

The commands are read from README.md, docs/*.md and slurm/*.sbatch as they stand (never a copy of them), and
each is rehearsed in-process with --dry-run at several world sizes on the planner's GPUs: it exits 0,
or 2 with one line a user can act on.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import import_train_ddp, optimizer_of, tiny_run_flags
from conftest import REPO

from gpt2.core.precision import Precision
from gpt2.data.shards import write_shard

WORLD_SIZES = (1, 8, 16, 32, 64)
GPUS = ("A100-40GB", "A100-80GB", "H100-80GB", "RTX4090-24GB")
TRAIN_TOKENS = 600_000  # more than one 524,288-token step, as few as possible
PLACEHOLDER_VALUE = {"--data-dir", "--out-dir"}


@pytest.fixture(scope="module")
def train_ddp():
    return import_train_ddp()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """A corpus just big enough for one step of the gpt2 preset (the dry run reads headers only)."""
    d = tmp_path_factory.mktemp("data")
    rng = np.random.default_rng(0)
    write_shard(d / "train_000000.bin", rng.integers(0, 50257, TRAIN_TOKENS // 2, dtype=np.uint16))
    write_shard(d / "train_000001.bin", rng.integers(0, 50257, TRAIN_TOKENS - TRAIN_TOKENS // 2, dtype=np.uint16))
    write_shard(d / "val_000000.bin", rng.integers(0, 50257, 20_000, dtype=np.uint16))
    return d


def dry(train_ddp, argv, capsys) -> tuple[int, str, str]:
    try:
        code = train_ddp.main([*argv, "--dry-run"])
    except SystemExit as e:  # a bad flag or value: argparse's exit, as on the command line
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---- reading the documented commands -------------------------------------------------------------


def logical_lines(text: str, markdown: bool = False) -> list[str]:
    """Lines with backslash continuations joined. Markdown: the lines of code blocks, and every inline
    `code span` of the prose as a line of its own."""
    out, pending, in_code = [], "", not markdown
    for raw in text.splitlines():
        if markdown and raw.startswith("```"):
            in_code = not in_code
            continue
        if in_code and raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        line, pending = pending + raw, ""
        out += [line] if in_code else re.findall(r"`([^`]+)`", line)
    return out


def shell_words(line: str) -> list[str]:
    line = line.strip().lstrip("#").strip()
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # prose with an apostrophe, not a command
        return []


def readme_commands() -> list[dict]:
    """{'kind': 'train', 'launcher': [...], 'args': [...]} or {'kind': 'sbatch', 'script': name, 'args': [...]}
    for every `python|torchrun ... train_ddp.py ARGS` and `sbatch ... slurm/X.sbatch ARGS` in README.md and
    docs/*.md."""
    from _helpers import guide_pages

    return [
        c
        for page in guide_pages()
        for c in commands_in(logical_lines(page.read_text(), markdown=True), str(page.relative_to(REPO)))
    ]


def commands_in(lines: list[str], source: str) -> list[dict]:
    found = []
    for line in lines:
        words = shell_words(line)
        if "train_ddp.py" in words and (words[0] in ("python", "torchrun") or words[0].startswith("python")):
            at = words.index("train_ddp.py")
            found.append(
                {
                    "kind": "train",
                    "launcher": words[:at],
                    "args": words[at + 1 :],
                    "source": source,
                    "line": line.strip(),
                }
            )
        scripts = [w for w in words if re.fullmatch(r"slurm/\w+\.sbatch", w)]
        if scripts and ("sbatch" in words or words[0] == "..."):
            at = words.index(scripts[0])
            found.append(
                {
                    "kind": "sbatch",
                    "script": scripts[0],
                    "args": words[at + 1 :],
                    "source": source,
                    "line": line.strip(),
                }
            )
    return [c for c in found if c["args"] and "--help" not in c["args"]]  # a bare mention is not a command


def sbatch_launch(script: Path) -> dict:
    """What an sbatch script gives train_ddp.py before the user's flags, and how it launches it."""
    text = script.read_text()
    common = (REPO / "slurm" / "common.sh").read_text()
    train_args = re.search(r"^\s*TRAIN_ARGS=\((.*)\)\s*$", common, re.M)
    assert train_args, "slurm/common.sh no longer sets TRAIN_ARGS=(...)"
    prefix = shlex.split(train_args.group(1))
    assert prefix[-1] == "$@", prefix  # the user's flags come last: they win
    prepare = re.search(r"^gpt2_prepare (.*)$", text, re.M)
    own = shlex.split(prepare.group(1))
    assert own[-1] == "$@", own
    launches = [line for line in logical_lines(text) if "train_ddp.py" in line and not line.lstrip().startswith("#")]
    assert len(launches) == 1 and '"${TRAIN_ARGS[@]}"' in launches[0], launches
    gpus = re.search(r"^#SBATCH --gpus-per-node=(\d+)", text, re.M)
    return {
        "prefix": prefix[:-1],
        "own": own[:-1],
        "multinode": "--nnodes" in launches[0],
        "gpus_per_node": int(gpus.group(1)),
    }


def sbatch_commands() -> list[dict]:
    """The README's sbatch lines and each script's own usage examples."""
    cmds = readme_commands()
    for script in sorted((REPO / "slurm").glob("*.sbatch")):
        comments = [line for line in script.read_text().splitlines() if line.startswith("#   ")]
        cmds += commands_in(logical_lines("\n".join(comments)), str(script.relative_to(REPO)))
    return [c for c in cmds if c["kind"] == "sbatch"]


def substitute(args: list[str], previous: list[str], data_dir: Path, out_dir: Path) -> list[str]:
    """Placeholders made concrete: --data-dir/--out-dir values (DIR, RUN, data/fineweb10B, ...) become a
    real data dir and a run dir here, RUN/ in other paths the run dir, and a bare `...` the flags of the
    previous complete command (as the README means it: "the command above, plus")."""
    out, i = [], 0
    while i < len(args):
        word = args[i]
        if word == "--data-dir" and i + 1 < len(args) and "," in args[i + 1]:  # a mixture: a link per source
            out += [word, ",".join(str(source_link(data_dir, name)) for name in args[i + 1].split(","))]
            i += 2
            continue
        if word in PLACEHOLDER_VALUE and i + 1 < len(args):
            out += [word, str(data_dir if word == "--data-dir" else out_dir)]
            i += 2
            continue
        if word == "...":
            out = [*previous, *out]
        else:
            out.append(re.sub(r"^RUN(?=/|$)", str(out_dir), word))
        i += 1
    return out


def source_link(data_dir: Path, source: str) -> Path:
    """A mixture's source, named as the docs name it (data/code: code), linked to the test's data dir."""
    link = data_dir.parent / "sources" / Path(source).name
    link.parent.mkdir(exist_ok=True)
    if not link.exists():
        link.symlink_to(data_dir)
    return link


def documented_runs(data_dir: Path, out_dir: Path) -> list[tuple[str, list[str], bool, int | None]]:
    """(what, trainer argv, on a GPU?, the command's own world size or None) for every documented command."""
    runs, previous = [], []
    for c in readme_commands():
        if c["kind"] != "train":
            continue
        args = substitute(c["args"], previous, data_dir, out_dir)
        if "..." not in c["args"]:
            previous = args
        launcher = " ".join(c["launcher"])
        nnodes = re.search(r"--nnodes[= ](\d+)", launcher)
        nproc = re.search(r"--nproc_per_node[= ](\d+)", launcher)
        world = int(nnodes.group(1) if nnodes else 1) * int(nproc.group(1) if nproc else 1)
        runs.append((f"{c['source']}: {c['line']}", args, not is_cpu(args), world))
    previous = []
    for c in sbatch_commands():
        launch = sbatch_launch(REPO / c["script"])
        prefix = [w.replace("$OUT_DIR", str(out_dir)).replace("$OMP_NUM_THREADS", "4") for w in launch["prefix"]]
        user = substitute(c["args"], previous, data_dir, out_dir)
        if "..." not in c["args"]:
            previous = user
        nodes = re.search(r"(?:--nodes|-N)[= ](\d+)", c["line"])
        world = launch["gpus_per_node"] * (int(nodes.group(1)) if nodes and launch["multinode"] else 1)
        args = [*prefix, *launch["own"], *user]
        runs.append((f"{c['source']}: {c['line']}", args, not is_cpu(args), world))
    return runs


def is_cpu(args: list[str]) -> bool:
    return any(a == "--device" and b == "cpu" for a, b in zip(args, args[1:]))


def test_the_documented_commands_are_found():
    """The parser reads what the docs say: a change that hides a command from it fails here."""
    train = [c for c in readme_commands() if c["kind"] == "train"]
    assert any("--nnodes=4" in c["launcher"] for c in train)  # the several-node command
    assert any(c["launcher"] == ["python"] and "--preset" in c["args"] for c in train)
    sbatch = sbatch_commands()
    assert {c["script"] for c in sbatch} == {f"slurm/{p.name}" for p in (REPO / "slurm").glob("*.sbatch")}
    for script in (REPO / "slurm").glob("*.sbatch"):
        sbatch_launch(script)  # exactly one train_ddp.py launch, with the user's flags last
    assert sbatch_launch(REPO / "slurm" / "debug_1gpu.sbatch")["own"] == ["--preset", "debug"]
    assert sbatch_launch(REPO / "slurm" / "train_multinode.sbatch")["multinode"]


ACTIONABLE = re.compile(r"--[a-z]|\buse\b|\braise\b|\bprepare\b|\bdrop\b|\bchoose\b")


@pytest.mark.slow  # ~45 s: every documented command at every size
def test_every_documented_command_rehearses_at_every_size(train_ddp, data_dir, tmp_path, capsys):
    """Each documented command, at world sizes 1-64 on each GPU (CPU commands on this CPU): exit 0, or
    2 with one line a user can act on. The several-node commands run at their own size."""
    runs = documented_runs(data_dir, tmp_path / "run")
    assert len(runs) >= 8
    outcomes = {}
    for what, args, gpu, _own_world in runs:
        for world in WORLD_SIZES:
            for device in GPUS if gpu else ("this cpu",):
                where = ["--world-size", str(world)]
                if gpu:
                    where += ["--gpu", device, "--nproc-per-node", str(min(world, 8))]
                code, out, err = dry(train_ddp, [*args, *where], capsys)
                key = (what, world, device)
                outcomes[key] = (code, err.strip(), args, gpu)
                if code == 0:
                    assert "dry run OK" in out or "nothing to train" in out, (key, out[-2000:])
                    assert err.strip() == "" or all(ln.startswith("warning: ") for ln in err.strip().splitlines()), key
                else:
                    assert code == 2, (key, code, err)
                    lines = err.strip().splitlines()
                    assert len(lines) == 1 and lines[0].startswith("train_ddp.py: error: "), (key, err)
                    assert ACTIONABLE.search(lines[0]), (key, lines[0])
    # What the rehearsal exists for: every GPU command of the GPT-2 recipe (a gpt2* preset, or the
    # defaults, which are gpt2's), several-node ones included, starts at every size on every GPU; they
    # stopped at start-up above 8 ranks while the micro-batch was a fixed 64. (The debug preset's
    # 2,048-token batch cannot be split over 8+ ranks, and an explicit missing checkpoint or --init-from
    # source is an error.)
    # A --parallel fsdp command is there for a model DDP cannot hold: at one rank nothing is sharded
    # (the trainer runs the plain model), so there it may only refuse, with the line checked above.
    recipe = {
        k: v
        for k, v in outcomes.items()
        if v[3]
        and preset_of(v[2]) != "debug"
        and resume_of(v[2]) in ("auto", "never")
        and not (parallel_of(v[2]) == "fsdp" and k[1] == 1)
        and "--init-from" not in v[2]
    }
    assert len(recipe) >= 8 * len(WORLD_SIZES) * len(GPUS)
    fsdp = {k for k, v in recipe.items() if parallel_of(v[2]) == "fsdp"}
    assert len({k[0] for k in fsdp}) >= 3  # README's torchrun and sbatch FSDP commands, the scripts' own
    assert all(v[0] == 0 for v in recipe.values()), {k: v[1] for k, v in recipe.items() if v[0]}
    several = {k[0] for k in recipe if "--nnodes=4" in k[0] or "--nodes=4" in k[0]}
    assert len(several) >= 2  # README's torchrun and sbatch lines


def preset_of(args: list[str]) -> str | None:
    values = [b for a, b in zip(args, args[1:]) if a == "--preset"]
    return values[-1] if values else None


def parallel_of(args: list[str]) -> str:
    values = [b for a, b in zip(args, args[1:]) if a == "--parallel"]
    return values[-1] if values else "ddp"


def resume_of(args: list[str]) -> str:
    values = [b for a, b in zip(args, args[1:]) if a == "--resume"]
    return values[-1] if values else "auto"


def test_the_several_node_command_at_its_own_size(train_ddp, data_dir, tmp_path, capsys):
    """README's 4 x 8 torchrun command: 32 ranks, 16 sequences each on an A100-40GB, in 1 micro-step of 16
    (the throughput model's micro-batch: 8 pays the measured 4 ms fixed cost twice)."""
    ((what, args, _, world),) = [r for r in documented_runs(data_dir, tmp_path / "run") if "--nnodes=4" in r[0]]
    assert world == 32
    code, out, err = dry(train_ddp, [*args, "--world-size", "32", "--gpu", "A100-40GB"], capsys)
    assert code == 0, err
    assert "32 rank(s) = 4 node(s) x 8" in out and "precision  bfloat16" in out
    assert "micro-batch auto: 16 sequences" in out and "-> 1 accumulation step(s)" in out
    window_lines = [ln for ln in out.splitlines() if ln.startswith("  rank ")]
    assert len(window_lines) == 32 and all(len(ln.split(":")[1].split()) == 16 for ln in window_lines)
    ids = [int(x) for ln in window_lines for x in ln.split(":")[1].split()]
    assert len(set(ids)) == 512  # every rank its own windows


def test_schedule_is_what_the_loader_reads(data_dir):
    """windows_of(m) names exactly the rows micro_batch(m) returns, for both orders, several ranks."""
    from gpt2.core.schedule import BatchLayout
    from gpt2.data.loader import TokenStream, TrainLoader, find_shards

    shards = find_shards(data_dir, "train")
    stream = TokenStream(shards, seed=0, shuffle=False)
    for order in ("shuffled", "sequential"):
        for rank in range(3):
            loader = TrainLoader(
                shards,
                BatchLayout(2, 64, 64 * 2 * 3 * 2, 3),
                rank=rank,
                seed=5,
                device=torch.device("cpu"),
                order=order,
            )
            loader.advance()
            for m in range(loader.accum_steps):
                x, y = loader.micro_batch(m)
                ids = loader.windows_of(m)
                if order == "shuffled":
                    rows = np.stack([stream.read(int(w) * 64, 65) for w in ids])
                else:
                    rows = np.stack([loader.stream.read(int(w) * 64, 65) for w in ids])
                assert np.array_equal(x.numpy(), rows[:, :-1]) and np.array_equal(y.numpy(), rows[:, 1:])


def test_what_does_not_fit_or_divide_is_one_actionable_line(train_ddp, data_dir, tmp_path, capsys):
    base = ["--data-dir", str(data_dir), "--out-dir", str(tmp_path / "run")]
    code, _, err = dry(train_ddp, [*base, "--preset", "gpt2-xl", "--world-size", "8", "--gpu", "RTX4090-24GB"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert re.search(
        r"gpt2-xl does not fit on RTX4090-24GB \(23.99 GiB\) with DDP at world size 8: "
        r"micro_batch_size=1 needs \d+\.\d+ GiB per device .* but \d+\.\d+ GiB is usable",
        err,
    ), err
    # its weights, gradients and AdamW state alone exceed the card: a shorter block would not help
    assert "a smaller model" in err and "more memory" in err and "--block-size" not in err
    # the state sharded over the 8 ranks would fit: --parallel fsdp is offered, with its total
    assert re.search(r"--parallel fsdp \(state sharded over the 8 ranks: \d+\.\d+ GiB\)", err), err
    # 524,288 tokens over 1024 ranks of 1024-token sequences: not even one sequence each
    code, _, err = dry(train_ddp, [*base, "--preset", "gpt2", "--world-size", "1024", "--gpu", "H100-80GB"], capsys)
    assert code == 2 and "less than one sequence per rank" in err and "at most 512 ranks" in err, err
    # an explicit micro-batch that cannot divide keeps its error, naming the sizes that do
    code, _, err = dry(
        train_ddp,
        [*base, "--preset", "gpt2", "--micro-batch-size", "64", "--world-size", "16", "--gpu", "A100-80GB"],
        capsys,
    )
    assert code == 2 and "not a multiple of micro_batch_size*block_size*world_size = 64*1024*16" in err, err
    assert "or --micro-batch-size 4, 8, 16, 32" in err


def test_dry_run_flags_need_dry_run_and_a_real_run_refuses_them(train_ddp, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train_ddp.main(["--data-dir", "d", "--out-dir", str(tmp_path), "--world-size", "8", "--gpu", "A100-40GB"])
    assert e.value.code == 2
    assert "--world-size, --gpu only rehearse a run: add --dry-run" in capsys.readouterr().err
    code, _, err = dry(train_ddp, ["--data-dir", "d", "--out-dir", str(tmp_path), "--gpu", "V100"], capsys)
    assert code == 2 and "unknown GPU 'V100'" in err
    code, _, err = dry(
        train_ddp,
        ["--preset", "debug", "--data-dir", "d", "--out-dir", str(tmp_path), "--device", "cpu", "--gpu", "A100-40GB"],
        capsys,
    )
    assert code == 2 and "drop one" in err
    assert not tmp_path.joinpath("metrics.jsonl").exists() and not any(tmp_path.iterdir())  # wrote nothing


def test_missing_data_is_said_and_the_rest_is_planned(train_ddp, tmp_path, capsys):
    code, out, err = dry(
        train_ddp,
        [
            "--preset",
            "gpt2",
            "--data-dir",
            str(tmp_path / "nowhere"),
            "--out-dir",
            str(tmp_path / "run"),
            "--world-size",
            "16",
            "--gpu-memory-gb",
            "24",
            "--gpu-peak-tflops",
            "100",
        ],
        capsys,
    )
    assert code == 0, err
    assert f"data       SKIPPED: --data-dir {tmp_path / 'nowhere'} does not exist here" in out
    assert "no such directory" in out  # what a real run would stop with
    assert "custom GPU is taken to have native bf16" in out and "hardware   16 x custom: 24.00 GiB" in out
    assert "rank  15 micro-step   0: rows" in out and not (tmp_path / "run").exists()


def test_resume_decision_without_loading_weights(train_ddp, data_dir, tmp_path, capsys):
    """A checkpoint in the run dir: the dry run names it, checks it against this run, and the first
    windows are the resumed step's."""
    from gpt2.ckpt import checkpoint as ckpt
    from gpt2.core.schedule import BatchLayout
    from gpt2.data.loader import TrainLoader, find_shards
    from gpt2.train.cli import parse_config

    run = tmp_path / "run"
    base = [
        "--n-layer",
        "2",
        "--n-head",
        "2",
        "--n-embd",
        "64",
        "--block-size",
        "64",
        "--micro-batch-size",
        "4",
        "--total-batch-size",
        "512",
        "--max-steps",
        "10",
        "--data-dir",
        str(data_dir),
        "--out-dir",
        str(run),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--data-order",
        "shuffled",
    ]
    cfg = parse_config(base)
    loader = TrainLoader(
        find_shards(data_dir, "train"),
        BatchLayout(4, 64, 512, 2),
        rank=0,
        seed=cfg.train.data.seed,
        device=torch.device("cpu"),
    )
    for _ in range(3):
        loader.advance()
    state = {
        "model": {},
        "optimizer": {"state": {}, "param_groups": []},
        "config": cfg.to_dict(),
        "tokenizer": "gpt2",
        "loader": loader.state_dict(),
        "rng": [],
        "world_size": 2,
        "tokens": 3 * 512,
    }
    ckpt.save_checkpoint(run, 3, state, keep=3)
    code, out, err = dry(train_ddp, [*base, "--world-size", "2"], capsys)
    assert code == 0, err
    assert f"would load {run}/checkpoints/step_00000003.pt (step 3" in out and "continue at step 3" in out
    assert "rank   0 micro-step   0: " + " ".join(str(int(i)) for i in loader.windows_of(0)) in out
    rank1 = TrainLoader(
        find_shards(data_dir, "train"),
        BatchLayout(4, 64, 512, 2),
        rank=1,
        seed=cfg.train.data.seed,
        device=torch.device("cpu"),
    )
    rank1.load_state_dict(loader.state_dict())
    assert "rank   1 micro-step   0: " + " ".join(str(int(i)) for i in rank1.windows_of(0)) in out
    # another seed: the real run's error, before any weight is read
    code, _, err = dry(train_ddp, [*base, "--world-size", "2", "--seed", "7"], capsys)
    assert code == 2 and "keep the seed to resume exactly" in err, err
    # another shape: refused as a real resume refuses it
    code, _, err = dry(train_ddp, [*base, "--world-size", "2", "--n-embd", "128"], capsys)
    assert code == 2 and "model shape differs" in err, err
    # a rollback (an explicit earlier checkpoint): the later ones a real run moves aside, moved by none here
    ckpt.save_checkpoint(run, 5, state, keep=3)
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    code, out, err = dry(
        train_ddp, [*base, "--world-size", "2", "--resume", f"{run}/checkpoints/step_00000003.pt"], capsys
    )
    assert code == 0, err
    assert (
        f"run dir    {run}/checkpoints/step_00000003.pt is an earlier checkpoint of this run: a real run moves its "
        f"later step_00000005.pt into {run}/checkpoints/abandoned-00000003-<UTC time>/ (nothing deleted)"
    ) in out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_a_fresh_start_in_a_used_directory_says_what_a_real_run_moves(train_ddp, data_dir, tmp_path, capsys):
    """--resume never over an earlier run: the dry run names the files a real run moves into previous-*/,
    and moves nothing itself."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 10.0}\n')
    before = sorted(p.name for p in run.iterdir())
    code, out, err = dry(
        train_ddp,
        [
            "--n-layer",
            "2",
            "--n-head",
            "2",
            "--n-embd",
            "64",
            "--block-size",
            "64",
            "--micro-batch-size",
            "4",
            "--total-batch-size",
            "512",
            "--data-dir",
            str(data_dir),
            "--out-dir",
            str(run),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--resume",
            "never",
        ],
        capsys,
    )
    assert code == 0, err
    [line] = [line for line in out.splitlines() if line.startswith("run dir")]
    assert "metrics.jsonl" in line and "previous-<UTC time>/" in line
    assert "--resume never: a fresh start at step 0" in out
    assert sorted(p.name for p in run.iterdir()) == before  # a dry run writes nothing


def test_a_held_run_directory_is_a_warning_and_the_rehearsal_takes_no_lock(train_ddp, data_dir, tmp_path, capsys):
    """RUN/run.lock held by a live run: a real start would be refused (exit 2); the dry run says so,
    leaves the lock as it is and exits 0 (it rehearses the configuration, which a requeue planned
    while the job still runs needs). Once the lock is released the warning is gone."""
    from gpt2.ckpt.rundir import LOCK, RunLock, describe_holder

    run = tmp_path / "run"
    argv = [
        "--n-layer",
        "2",
        "--n-head",
        "2",
        "--n-embd",
        "64",
        "--block-size",
        "64",
        "--micro-batch-size",
        "4",
        "--total-batch-size",
        "512",
        "--data-dir",
        str(data_dir),
        "--out-dir",
        str(run),
        "--device",
        "cpu",
        "--dtype",
        "float32",
    ]
    lock = RunLock.acquire(run)
    try:
        held = (run / LOCK).read_bytes()
        code, out, err = dry(train_ddp, argv, capsys)
        assert code == 0, err
        assert (
            f"warning: {run} is in use by another training run ({describe_holder(lock.record)}; {run}/{LOCK}): "
            "a real start now would be refused (exit 2) and touch nothing. The dry run took no lock"
        ) in out
        assert "dry run OK" in out
        assert sorted(p.name for p in run.iterdir()) == [LOCK] and (run / LOCK).read_bytes() == held
    finally:
        lock.release()
    code, out, err = dry(train_ddp, argv, capsys)
    assert code == 0 and "in use by another training run" not in out + err


def test_dry_run_and_start_up_count_the_epochs_and_warn_when_many(train_ddp, tmp_path, capsys):
    """--preset gpt2 over a 693,489-token corpus planned ~14,400 epochs and said `dry run OK`: the epochs are
    a line of the dry run and of a real start-up, and more than 10 are a warning (not an error)."""
    from gpt2.train.startup import MANY_EPOCHS

    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    write_shard(data / "train_000000.bin", rng.integers(0, 50257, 600, dtype=np.uint16))
    write_shard(data / "val_000000.bin", rng.integers(0, 50257, 600, dtype=np.uint16))
    argv = [
        *tiny_run_flags(data, max_steps=12, ckpt_interval=0),
        "--out-dir",
        str(tmp_path / "run"),
        "--device",
        "cpu",
        "--sample-interval",
        "0",
    ]
    epochs = (
        "epochs     10.24 over the train split: 12 steps x 512 tokens = 6,144 tokens planned, the train shards hold 600"
    )
    warning = (
        f"warning: the run repeats the train split 10 times (more than {MANY_EPOCHS} epochs): the model will "
        "memorise this corpus more than it learns; about 1 step(s) make one epoch, so pass --max-steps 10 or "
        "fewer, or prepare more data"
    )
    code, out, err = dry(train_ddp, argv, capsys)
    assert code == 0 and epochs in out.splitlines() and warning in out.splitlines(), out + err
    assert train_ddp.main([*argv, "--verbose"]) == 0  # a real start: the same line (detail) and warning, then it trains
    captured = capsys.readouterr()
    assert epochs in captured.out.splitlines() and warning in captured.err.splitlines(), captured
    log = (tmp_path / "run" / "train.log").read_text().splitlines()  # without --verbose: in RUN/train.log
    assert epochs in log and warning in log
    # a few epochs, as a fine-tune makes on purpose: the line, no warning
    code, out, err = dry(train_ddp, [*argv, "--max-steps", "2", "--out-dir", str(tmp_path / "two")], capsys)
    assert code == 0 and "epochs     1.71 over the train split" in out and "repeats the train split" not in out + err


def test_a_world_size_that_is_no_whole_number_of_8_gpu_nodes_is_refused_with_the_choices(
    train_ddp, data_dir, tmp_path, capsys
):
    """--world-size 12 used to become "3 node(s) x 4" although 8 per node is the default: now one line says
    why not and how to choose; a smaller world is one node, and --nproc-per-node decides the layout."""
    base = [
        "--preset",
        "gpt2",
        "--data-dir",
        str(data_dir),
        "--out-dir",
        str(tmp_path / "run"),
        "--gpu",
        "A100-40GB",
        "--total-batch-size",
        str(12 * 1024 * 40),
    ]  # divisible by 12 and 6 ranks
    code, out, err = dry(train_ddp, [*base, "--world-size", "12"], capsys)
    assert code == 2 and "node(s)" not in out
    assert err == (
        "train_ddp.py: error: --world-size 12 is not a whole number of 8-GPU nodes (the default ranks per "
        "node): pass --nproc-per-node 6 (2 nodes) or --nproc-per-node 4 (3 nodes), or --world-size 8 or "
        "16\n"
    )
    code, out, err = dry(train_ddp, [*base, "--world-size", "12", "--nproc-per-node", "6"], capsys)
    assert code == 0 and "12 rank(s) = 2 node(s) x 6" in out, err
    code, out, err = dry(train_ddp, [*base, "--world-size", "6"], capsys)
    assert code == 0 and "6 rank(s) = 1 node(s) x 6" in out, err


def test_plan_cli_and_trainer_plan_the_same_preset(train_ddp, data_dir, tmp_path, capsys):
    """`python -m gpt2.plan --preset gpt2 --gpu X --world-size W` prints the plan the dry run (and a real
    run's start-up) prints: the preset's 524,288-token batch and auto micro-batch, not a default of its own."""
    from gpt2.plan.__main__ import main as plan_main

    for gpu, world in (("A100-40GB", 1), ("RTX4090-24GB", 8), ("H100-80GB", 64)):
        assert plan_main(["--preset", "gpt2", "--gpu", gpu, "--world-size", str(world)]) == 0
        first, micro_batch, planned = capsys.readouterr().out.strip().split("\n", 2)
        assert first == f"plan for   {world} x {gpu} (--gpu)"  # the CLI's own line: what the plan is for
        assert micro_batch.startswith("micro-batch auto: ")
        code, out, err = dry(
            train_ddp,
            [
                "--preset",
                "gpt2",
                "--data-dir",
                str(data_dir),
                "--out-dir",
                str(tmp_path / "run"),
                "--world-size",
                str(world),
                "--gpu",
                gpu,
            ],
            capsys,
        )
        assert code == 0, err
        assert micro_batch in out.splitlines() and planned in out, (gpu, world)  # the same decisions, word for word
        assert "total_batch_size=524,288" in planned


def test_the_24gb_card_is_in_both_tables():
    from gpt2.plan.flops import gpu_table_peak
    from gpt2.plan.hardware import GIB, GPUS

    memory, sheet_name = GPUS["RTX4090-24GB"]
    assert 23 * GIB < memory < 24 * GIB
    assert gpu_table_peak(sheet_name, torch.bfloat16) == 165e12


def test_checkpoint_size_estimate_is_what_a_save_writes(tmp_path):
    """The dry run's checkpoint size (fp32 weights + optimizer state, from the planner) against
    torch.save of a model and its AdamW state after one step."""
    from gpt2.core.config import ModelConfig, TrainConfig
    from gpt2.model.gpt import GPT
    from gpt2.plan.hardware import device_hardware
    from gpt2.plan.memory import memory, run_config

    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=64)
    model = GPT(cfg)
    opt = optimizer_of(model, TrainConfig.of(data_dir="d", out_dir="o", fused_adamw=False), torch.device("cpu"))
    x = torch.randint(0, 50257, (2, 64))
    model(x, x)[1].backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "c.pt")
    m = memory(run_config(cfg, 1, prec=Precision.from_key("fp32")), device_hardware("cpu", None))
    written = (tmp_path / "c.pt").stat().st_size
    assert abs(written - (m.weights + m.optimizer)) / written < 0.02, (written, m.weights + m.optimizer)


def test_the_loss_path_is_chosen_and_printed_as_a_real_run_would(train_ddp, data_dir, tmp_path, capsys):
    """--loss-impl auto: full logits where they are a small share of the GPU (the debug preset's 8 x 128
    tokens, compiled; gpt2 at its auto micro-batch of 16), chunked where a micro-batch fills it (gpt2 at 128)
    or the model runs eager (the debug preset's default); the plan counts the path it names; an explicit full
    that cannot fit is one actionable line."""
    base = ["--data-dir", str(data_dir), "--out-dir", str(tmp_path / "run"), "--gpu", "A100-80GB"]
    code, out, err = dry(train_ddp, [*base, "--preset", "debug"], capsys)
    assert code == 0 and "loss       chunked: " in out and "(auto: uncompiled and not measured on A100-80GB" in out
    code, out, err = dry(train_ddp, [*base, "--preset", "debug", "--compile", "true"], capsys)
    assert code == 0, err
    assert re.search(
        r"^loss       full logits: .* \(auto: full-logits peak 0\.19 GiB at micro-batch 8 <= 1/8 of "
        r"77\.10 GiB usable",
        out,
        re.M,
    ), out
    assert "LM head + loss peak    0.19 GiB  (full logits" in out
    code, out, err = dry(train_ddp, [*base, "--preset", "gpt2"], capsys)
    assert code == 0, err
    assert "micro-batch auto: 16 sequences" in out  # the throughput model's micro-batch first, then the loss path
    assert re.search(
        r"^loss       full logits: .* \(auto: full-logits peak 3\.07 GiB at micro-batch 16 <= 1/8", out, re.M
    )
    big = [*base, "--preset", "gpt2", "--micro-batch-size", "128"]
    code, out, err = dry(train_ddp, big, capsys)
    assert code == 0, err
    assert re.search(r"^loss       chunked: .* \(auto: full-logits peak 24\.56 GiB at micro-batch 128 > 1/8", out, re.M)
    assert re.search(r"LM head \+ loss peak +3\.66 GiB +\(chunked", out)  # compiled or not: one chunk (one op)
    code, out, err = dry(train_ddp, [*big, "--loss-impl", "chunked"], capsys)
    assert code == 0 and "loss       chunked: " in out and "(--loss-impl chunked)" in out
    code, out, err = dry(train_ddp, [*big, "--loss-impl", "full"], capsys)
    assert code == 0 and "--loss-impl full; full-logits peak 24.56 GiB at micro-batch 128, above the 1/8 share" in out
    code, _, err = dry(train_ddp, [*big, "--loss-impl", "full", "--compile", "false"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1  # eager's peak does not fit
    assert "--loss-impl full: the plan with the full-logits peak 73.69 GiB" in err and "use --loss-impl chunked" in err
    code, _, err = dry(train_ddp, [*base, "--preset", "debug", "--loss-impl", "fused"], capsys)
    assert code == 2 and "loss_impl='fused' must be one of ('auto', 'chunked', 'full')" in err


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_fsdp_dry_run_shows_the_sharded_plan(train_ddp, data_dir, tmp_path, capsys, world):
    """gpt2-xl with --parallel fsdp on 24 GB cards: refused with the fix at one rank (nothing to shard),
    planned sharded from 8 ranks on, each rank's shard of the state and the checkpoint's shards named."""
    args = [
        "--preset",
        "gpt2-xl",
        "--parallel",
        "fsdp",
        "--data-dir",
        str(data_dir),
        "--out-dir",
        str(tmp_path / "run"),
        "--world-size",
        str(world),
        "--gpu",
        "RTX4090-24GB",
        "--nproc-per-node",
        str(min(world, 8)),
    ]
    code, out, err = dry(train_ddp, args, capsys)
    if world == 1:
        assert code == 2 and "does not fit on RTX4090-24GB" in err and "several ranks" in err, err
        return
    assert code == 0, err
    assert "parallel fsdp" in out and f"FSDP over {world} ranks" in out and f"1/{world} shard" in out
    assert "gathered weights" in out and "fits       yes" in out
    assert f"each of the {world} ranks writing its" in out
    ddp_code, _, ddp_err = dry(train_ddp, [a if a != "fsdp" else "ddp" for a in args], capsys)
    assert ddp_code == 2 and "--parallel fsdp" in ddp_err  # what DDP cannot hold, and the fix named


def test_fsdp_dry_run_on_this_cpu_at_two_ranks(train_ddp, data_dir, tmp_path, capsys):
    """The bench's shape rehearsed on this machine (2 ranks sharing its RAM): the sharded plan, fp32."""
    code, out, err = dry(
        train_ddp,
        [
            "--preset",
            "gpt2-medium",
            "--parallel",
            "fsdp",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--block-size",
            "128",
            "--micro-batch-size",
            "1",
            "--total-batch-size",
            "256",
            "--data-dir",
            str(data_dir),
            "--out-dir",
            str(tmp_path / "run"),
            "--world-size",
            "2",
        ],
        capsys,
    )
    assert code == 0, err
    assert "FSDP over 2 ranks" in out and "gathered weights" in out and "(fp32:" in out


@pytest.mark.slow
def test_the_gpt2_recipe_on_a_cpu_is_said_in_one_line_with_the_debug_preset(train_ddp, data_dir, tmp_path, capsys):
    """Issue 41: a tiny model with no --preset on a CPU takes the gpt2 recipe's 524,288-token steps and 10M eval
    tokens; the start-up (and so its dry run) says so once, with the plan's time and --preset debug. A CPU-sized
    recipe and a GPU rehearsal of the same flags say nothing."""
    tiny = [
        "--n-layer",
        "2",
        "--n-head",
        "2",
        "--n-embd",
        "64",
        "--block-size",
        "64",
        "--dtype",
        "float32",
        "--compile",
        "false",
        "--max-steps",
        "30",
        "--data-dir",
        str(data_dir),
        "--out-dir",
        str(tmp_path / "r"),
    ]
    code, out, err = dry(train_ddp, [*tiny, "--device", "cpu"], capsys)
    assert code == 0, err
    lines = [ln for ln in out.splitlines() if "recipe: the gpt2 recipe" in ln]
    assert len(lines) == 1 and lines[0].startswith("warning: recipe: ")
    assert "the gpt2 recipe's 524,288-token steps (~" in lines[0] and "for 30 steps at the plan's estimate" in lines[0]
    assert "and 10,485,760 tokens per evaluation on a CPU" in lines[0]
    assert "pass --preset debug (2,048-token steps, 8,192 eval tokens)" in lines[0]
    code, out, _ = dry(
        train_ddp, [*tiny, "--device", "cpu", "--total-batch-size", "4096", "--eval-tokens", "8192"], capsys
    )
    assert code == 0 and "recipe: the gpt2 recipe" not in out
    code, out, _ = dry(train_ddp, [*tiny, "--gpu", "A100-80GB"], capsys)
    assert code == 0 and "recipe: the gpt2 recipe" not in out
