"""Command line -> RunConfig. Every config field is a kebab-case flag.

Precedence: dataclass defaults < --preset < --arch < --config FILE.toml < flags. Nothing here touches
torch.distributed: a bad flag or value fails before any process group starts.

--dry-run and the flags that only make sense with it (--world-size, --nproc-per-node, --gpu,
--gpu-memory-gb, --gpu-peak-tflops) are not config fields: they say where to rehearse the run
(gpt2/train/dryrun.py), and parse_command returns them beside the RunConfig.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import math
import sys
import textwrap
import types
import typing
from pathlib import Path

from gpt2.core.args import OneLineParser
from gpt2.core.config import (
    ARCHS,
    MODEL_PRESETS,
    TRAIN_ONLY_PRESETS,
    TRAIN_PRESETS,
    TRAIN_SECTIONS,
    ModelConfig,
    RunConfig,
    TrainConfig,
    tied_head_lr_problem,
)

PRESETS = sorted({*MODEL_PRESETS, *TRAIN_PRESETS})
"""--preset's names: a model shape with its recipe, or a recipe alone (finetune: the shape comes from --init-from)."""

SECTIONS: dict[str, type] = {"model": ModelConfig, **TRAIN_SECTIONS}
"""--help's headings: the model, then TrainConfig's sections, each with its fields in the order declared; a
heading's name is its config section's (cfg.train.optim: "optim"), which is
also its table's name in a --config file. torchtitan groups its config alike, so a person finds a flag by
scanning a heading."""
REQUIRED_FIELDS = ("data_dir", "out_dir")
"""Fields with no usable default: a run names them (config_from_args says so, --help shows them as required)."""
HELP_WIDTH = 100
"""The terminal width --help is laid out for: at this width (or wider) every flag is one line."""
HELP_COLUMN = 36
"""Where a flag's help starts: after the longest flag with its metavar (--tie-embeddings [{true,false}])."""
USAGE = "python train_ddp.py [--preset NAME] --data-dir DIR --out-dir DIR [--FLAG VALUE ...]"
"""torchrun ... train_ddp.py takes the same flags; --help lists them under headings."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rehearsal:
    """train_ddp.py --dry-run: where to rehearse the run (gpt2/train/dryrun.py)."""

    world_size: int | None = None
    """Ranks of the hypothetical run; None: this launch's (torchrun's WORLD_SIZE, else 1)."""
    nproc_per_node: int | None = None
    """Ranks per node; None: all on one node (CPU), up to 8 per node (GPU)."""
    gpu: str | None = None
    """A GPU of the planner's table, instead of this machine's device."""
    gpu_memory_gb: float | None = None
    gpu_peak_tflops: float | None = None

    @property
    def hypothetical_gpu(self) -> bool:
        return self.gpu is not None or self.gpu_memory_gb is not None


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_bool(text: str) -> bool:
    low = str(text).strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def int_or_auto(text: str) -> int | str:
    """An integer, or the word auto (a field the trainer sizes itself, e.g. --micro-batch-size)."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or auto, got {text!r}") from None


def float_or_none(text: str) -> float | None:
    """A number, or the word none (a float field that can be off, e.g. --logit-softcap none)."""
    if str(text).strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or none, got {text!r}") from None


@functools.cache
def _type_hints(cls) -> dict:
    """typing.get_type_hints of a config section, resolved once: the parser asks for each field's type, and
    resolving the class's annotations every time was most of a `--dry-run`'s parse (18 of the every-size
    rehearsal's 88 s)."""
    return typing.get_type_hints(cls)


def _field_type(cls, field: dataclasses.Field):
    """The concrete scalar type of a dataclass field (Optional[int] -> int; int | str -> int_or_auto;
    Optional[float] -> float_or_none)."""
    hint = _type_hints(cls)[field.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if set(args) == {int, str}:
            return int_or_auto
        if args == [float]:
            return float_or_none
        hint = args[0]
    return hint


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """The first paragraph of the docstring written under each dataclass field, on one line: its flag's help
    (the paragraphs after it say more, in gpt2/core/config.py)."""
    docs = {}
    body = ast.parse(inspect.getsource(cls)).body[0].body
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split("\n\n")[0].split())
    return docs


def _first_line(doc: str) -> str:
    return inspect.cleandoc(doc).split("\n\n")[0].replace("\n", " ")


def shown_default(value) -> str:
    """A default as --help shows it: as the flag is typed (true, auto, 0.0006), "none" for None or empty."""
    if isinstance(value, bool):
        return str(value).lower()
    return "none" if value is None or value == "" else str(value)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """argparse's layout with the help column after the longest flag, so that at HELP_WIDTH columns each flag
    is one line; the description and epilog (the presets' table) are printed as written."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=HELP_COLUMN)


def flag_entries(table: dict[str, dict], width: int) -> list[str]:
    """One entry per name of table, its values as the flags they stand for, wrapped under the name."""
    lines = []
    for name, values in table.items():
        # a no-break space inside each "--flag value" pair, so that a line never ends between them
        flags = " ".join(f"--{k.replace('_', '-')}\N{NO-BREAK SPACE}{shown_default(v)}" for k, v in values.items())
        lines += [
            line.replace("\N{NO-BREAK SPACE}", " ")
            for line in textwrap.wrap(
                flags,
                width,
                initial_indent=f"  {name:<14}",
                subsequent_indent=" " * 16,
                break_on_hyphens=False,
                break_long_words=False,
            )
        ]
    return lines


def presets_epilog(width: int = HELP_WIDTH - 2) -> str:
    """What each --arch and --preset sets, as the flags it stands for: one entry per name, wrapped under it."""
    lines = ["architectures (--arch NAME sets these flags, at any size; docs/modern.md):"]
    lines += flag_entries(ARCHS, width)
    lines += ["", "presets (--preset NAME sets these flags; --config and flags given after it override them):"]
    names = [*MODEL_PRESETS, *(p for p in TRAIN_PRESETS if p not in MODEL_PRESETS)]
    lines += flag_entries({n: {**MODEL_PRESETS.get(n, {}), **TRAIN_PRESETS.get(n, {})} for n in names}, width)
    lines += [
        "",
        "Each flag's help is the first line of the docstring under its field in gpt2/core/config.py",
        "(ModelConfig, TrainConfig); the lines after it say more. docs/training.md explains the main ones.",
    ]
    return "\n".join(lines)


def _fields():
    """(section, field, type) for every config field in --help's order: the model's, then each training section's."""
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            yield section, f, _field_type(cls, f)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="train_ddp.py",
        usage=USAGE,
        formatter_class=HelpFormatter,
        epilog=presets_epilog(),
        description="Train GPT-2. Launch with torchrun for several processes, or with python for one.",
        allow_abbrev=False,
    )
    start = parser.add_argument_group(
        "preset and config file", "Precedence: defaults < --preset < --arch < --config FILE.toml < flags."
    )
    start.add_argument(
        "--preset",
        choices=PRESETS,
        default=None,
        metavar="NAME",
        help="Model shape and recipe to start from (default: none)",
    )
    start.add_argument(
        "--arch",
        choices=sorted(ARCHS),
        default=None,
        metavar="NAME",
        help="Architecture options at once: gpt2 or modern (default: none)",
    )
    start.add_argument(
        "--config",
        metavar="FILE.toml",
        default=None,
        help="TOML file, or RUN/config.json to repeat a run (default: none)",
    )
    groups = {}
    for section, f, typ in _fields():
        if section not in groups:
            groups[section] = parser.add_argument_group(section, _first_line(SECTIONS[section].__doc__))
        add_field_flag(groups[section], section, f, typ)
    rehearsal = parser.add_argument_group(
        "dry run",
        "--dry-run goes through everything up to the first step and prints it; exit 0, or 2 with the\n"
        "error a real run would give. No process group, no weights. The other flags here need --dry-run.",
    )
    rehearsal.add_argument("--dry-run", action="store_true", help="Rehearse the run, then exit (default: false)")
    rehearsal.add_argument(
        "--world-size", type=int, metavar="N", help="Ranks of the rehearsed run (default: this launch's)"
    )
    rehearsal.add_argument(
        "--nproc-per-node", type=int, metavar="N", help="Its ranks per node (default: up to 8 on GPUs, all on a CPU)"
    )
    rehearsal.add_argument(
        "--gpu", metavar="NAME", help="A GPU of python -m gpt2.plan's table (default: this machine's)"
    )
    rehearsal.add_argument(
        "--gpu-memory-gb", type=float, metavar="GIB", help="Or a GPU with this much memory (default: none)"
    )
    rehearsal.add_argument(
        "--gpu-peak-tflops", type=float, metavar="TFLOPS", help="And this peak in the run's dtype (default: none)"
    )
    return parser


def add_field_flag(group, section: str, f: dataclasses.Field, typ) -> None:
    """A config field's flag: --kebab-case, its docstring's first line and its default as help."""
    cls = SECTIONS[section]
    default = "required" if f.name in REQUIRED_FIELDS else f"default: {shown_default(f.default)}"
    kwargs = dict(
        dest=f"{section}.{f.name}", default=None, help=f"{field_docs(cls)[f.name].removesuffix('.')} ({default})"
    )
    if typ is bool:  # a bare --verbose (or --compile) means true
        kwargs.update(type=parse_bool, metavar="{true,false}", nargs="?", const=True)
    elif typ is int_or_auto:
        kwargs.update(type=typ, metavar="{INT,auto}")
    elif typ is float_or_none:
        # Absent unless given: "--logit-softcap none" gives None, which must still override --arch's cap.
        kwargs.update(type=typ, metavar="FLOAT", default=argparse.SUPPRESS)
    else:
        kwargs.update(type=typ, metavar=typ.__name__.upper())
    group.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def load_toml(path: str) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config {path}: no such file")
    if p.suffix == ".json":
        return load_run_record(p)
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: not valid TOML: {e}") from None
    return data


def load_run_record(path: Path) -> dict:
    """A run's RUN/config.json (what every run writes: its whole config under "config", as the TOML tables
    [model] and [train.SECTION] hold it) as a --config file's values, to repeat that run. Its out_dir is not
    taken: that is the recorded run's own directory, which a repeat would resume or collide with; the new
    run's --out-dir is given as a flag."""
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--config {path}: not valid JSON: {e}") from None
    config = record.get("config", record) if isinstance(record, dict) else None
    if not isinstance(config, dict) or not isinstance(config.get("train"), dict):
        raise ValueError(
            f'--config {path}: not a run\'s config.json (no "config" with model and train settings); '
            "give a run's RUN/config.json or a TOML file of field = value lines"
        )
    train = {k: dict(v) if isinstance(v, dict) else v for k, v in config["train"].items()}
    for table in (train, train.get("ckpt", {})):  # flat (an older run's record) or in its section
        if isinstance(table, dict):
            table.pop("out_dir", None)
    return {"model": dict(config.get("model", {})), "train": train}


def _split_file_values(data: dict, path: str) -> dict[str, dict]:
    """A --config file's values -> {"model": {...}, "train": {...}} (flat field names); unknown keys are errors.

    The file names a field flat (lr = 3e-4), in its section's table ([optim] lr = 3e-4, as --help's headings
    name them; also [train.optim]), or in a [model] or [train] table (what versions before the sections read)."""
    known = {name: (section, typ) for section, f, typ in _fields() for name in [f.name]}
    out: dict[str, dict] = {"model": {}, "train": {}}
    entries = []  # (name, value, as the file writes it)
    for key, value in data.items():
        if key in ("preset", "arch"):
            out[key] = value
        elif key in ("model", "train", *TRAIN_SECTIONS) and isinstance(value, dict):
            for k, v in value.items():
                if key == "train" and k in TRAIN_SECTIONS and isinstance(v, dict):
                    entries += [(kk.replace("-", "_"), vv, f"train.{k}.{kk}", k) for kk, vv in v.items()]
                else:
                    entries.append((k.replace("-", "_"), v, f"{key}.{k}", key))
        else:
            entries.append((key.replace("-", "_"), value, key, None))
    unknown = [shown for name, _, shown, table in entries if not _belongs(name, table, known)]
    if unknown:
        raise ValueError(f"--config {path}: unknown keys {unknown}; see train_ddp.py --help for the fields")
    for name, value, _, _ in entries:
        section, typ = known[name]
        if typ is float_or_none:  # TOML has no null: the word none, or a number
            value, typ = (None, type(None)) if str(value).lower() == "none" else (value, float)
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if typ is int_or_auto:
            typ = int if value != "auto" else str
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise ValueError(f"--config {path}: {name} = {value!r} should be of type {typ.__name__}")
        out["model" if section == "model" else "train"][name] = value
    return out


def _belongs(name: str, table: str | None, known: dict) -> bool:
    """Whether a --config key is a field of the table it is in (None: flat, any field; train: any training field)."""
    if name not in known:
        return False
    section = known[name][0]
    return table is None or table == section or (table == "train" and section != "model")


def parse_config(argv: list[str] | None = None) -> RunConfig:
    """Parse the command line into a validated RunConfig (raises SystemExit(2) on bad input)."""
    return parse_command(argv)[0]


def parse_command(argv: list[str] | None = None) -> tuple[RunConfig, Rehearsal | None]:
    """The RunConfig, and the Rehearsal under --dry-run (else None). SystemExit(2) on bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return config_from_args(args), rehearsal_of(args)
    except ValueError as e:
        parser.exit(2, f"train_ddp.py: error: {e}\n")


def rehearsal_of(args: argparse.Namespace) -> Rehearsal | None:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Rehearsal) if getattr(args, f.name) is not None}
    if not args.dry_run:
        if given:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            raise ValueError(
                f"{flags} only rehearse a run: add --dry-run (a real run takes its world size from "
                "torchrun and its device from the machine)"
            )
        return None
    r = Rehearsal(**given)
    for name in ("world_size", "nproc_per_node", "gpu_memory_gb", "gpu_peak_tflops"):
        value = getattr(r, name)
        if value is not None and not (math.isfinite(value) and value > 0):  # inf would plan an infinite GPU
            raise ValueError(f"--{name.replace('_', '-')} {value} must be a finite number > 0")
    if r.nproc_per_node is not None and r.world_size is not None and r.world_size % r.nproc_per_node:
        raise ValueError(
            f"--world-size {r.world_size} is not a multiple of --nproc-per-node {r.nproc_per_node}: "
            "every node runs the same number of ranks"
        )
    if r.gpu_peak_tflops is not None and r.gpu is None and r.gpu_memory_gb is None:
        raise ValueError("--gpu-peak-tflops needs --gpu-memory-gb (or --gpu): the planner needs the memory")
    return r


def config_from_args(args: argparse.Namespace) -> RunConfig:
    file_values = _split_file_values(load_toml(args.config), args.config) if args.config else {}
    preset = args.preset or file_values.pop("preset", None)
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {PRESETS}")
    arch = args.arch or file_values.pop("arch", None)
    if arch is not None and arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {sorted(ARCHS)}")
    values = {"model": {}, "train": {}}
    given_by = {}  # model field -> what set it (named in a clash with --init-from's weights)
    if preset:
        values["model"].update(MODEL_PRESETS.get(preset, {}))
        values["train"].update(TRAIN_PRESETS.get(preset, {}))
        given_by |= {k: f"--preset {preset}" for k in MODEL_PRESETS.get(preset, {})}
    if arch:  # after the preset (a shape), before the file and flags (single options override it)
        values["model"].update(ARCHS[arch])
        given_by |= {k: f"--arch {arch}" for k in ARCHS[arch]}
    for section in ("model", "train"):
        values[section].update(file_values.get(section, {}))
    given_by |= {k: f"--config {args.config}" for k in file_values.get("model", {})}
    nullable = {f"{section}.{f.name}" for section, f, typ in _fields() if typ is float_or_none}  # given if present
    for key, value in vars(args).items():
        if "." in key and (value is not None or key in nullable):
            section, name = key.split(".", 1)
            values["model" if section == "model" else "train"][name] = value
            given_by[name] = "--" + name.replace("_", "-")
    train = TrainConfig.of(**values["train"])
    given = train.flat()
    missing = ["--" + name.replace("_", "-") for name in REQUIRED_FIELDS if not given[name]]
    if "--out-dir" in missing and args.config and Path(args.config).suffix == ".json":
        raise ValueError(
            f"--out-dir is required with --config {args.config}: a run's record repeats its settings, not its "
            f"directory; give the new run's (to continue that run instead: --out-dir {Path(args.config).parent} "
            "--resume auto, with no --config)"
        )
    if missing:
        raise ValueError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required")
    if train.ckpt.init_from:
        values["model"] = shape_from_weights(train.ckpt.init_from, values["model"], given_by)
    elif preset in TRAIN_ONLY_PRESETS:
        raise ValueError(
            f"--preset {preset} is a recipe for trained weights: add --init-from (a Hugging Face "
            "GPT-2 directory, a checkpoint or run directory of ours, or a hub name)"
        )
    model = ModelConfig(**values["model"])
    if problem := tied_head_lr_problem(model.tie_embeddings, train.optim):
        raise ValueError(problem)
    return RunConfig(model, train)


def shape_from_weights(spec: str, model_values: dict, given_by: dict) -> dict:
    """The model fields with --init-from's shape (gpt2/train/init_from.py reads it without the weights); a
    value given otherwise (flag, --config, --preset) that differs is an error naming both."""
    from gpt2.train.init_from import describe_source  # here: a run without --init-from never imports it

    shape = describe_source(spec).shape
    clashes = [
        f"{given_by.get(k, k)} gives {k}={model_values[k]!r}, the weights have {k}={v!r}"
        for k, v in shape.items()
        if k in model_values and model_values[k] != v and not (k == "n_kv_head" and model_values[k] is None)
    ]
    if clashes:
        raise ValueError(
            f"--init-from {spec}: the model's shape comes from the weights, but "
            + "; ".join(clashes)
            + ": drop those settings"
        )
    return {**model_values, **shape}
