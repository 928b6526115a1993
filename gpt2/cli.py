"""Command line -> RunConfig. Every config field is a kebab-case flag.

Precedence: dataclass defaults < --preset < --config FILE.toml < flags. Nothing here touches
torch.distributed: a bad flag or value fails before any process group starts.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import sys
import types
import typing
from pathlib import Path

from gpt2.config import MODEL_PRESETS, TRAIN_PRESETS, ModelConfig, RunConfig, TrainConfig

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


def _field_type(cls, field: dataclasses.Field):
    """The concrete scalar type of a dataclass field (Optional[int] -> int; int | str -> int_or_auto)."""
    hint = typing.get_type_hints(cls)[field.name]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if set(args) == {int, str}:
            return int_or_auto
        hint = args[0]
    return hint


@functools.lru_cache(maxsize=None)
def field_docs(cls) -> dict[str, str]:
    """The docstring written under each dataclass field (the help text of its flag)."""
    docs = {}
    body = ast.parse(inspect.getsource(cls)).body[0].body
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _fields():
    """(section, field, type) for every config field, model first."""
    for section, cls in (("model", ModelConfig), ("train", TrainConfig)):
        for f in dataclasses.fields(cls):
            yield section, f, _field_type(cls, f)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train_ddp.py",
        description="Train GPT-2. Launch with torchrun for several processes, or with python for one.",
        allow_abbrev=False,
    )
    parser.add_argument("--preset", choices=sorted(MODEL_PRESETS), default=None,
                        help="model shape and training recipe to start from")
    parser.add_argument("--config", metavar="FILE.toml", default=None,
                        help="TOML file of field = value (flat, or under [model] / [train])")
    for section, f, typ in _fields():
        cls = ModelConfig if section == "model" else TrainConfig
        doc = field_docs(cls).get(f.name, "")
        kwargs = dict(dest=f"{section}.{f.name}", default=None, help=f"{doc} (default: {f.default})")
        if typ is bool:
            kwargs.update(type=parse_bool, metavar="{true,false}")
        elif typ is int_or_auto:
            kwargs.update(type=typ, metavar="{INT,auto}")
        else:
            kwargs.update(type=typ, metavar=typ.__name__.upper())
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)
    return parser


def load_toml(path: str) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config {path}: no such file")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: not valid TOML: {e}") from None
    return data


def _split_file_values(data: dict, path: str) -> dict[str, dict]:
    """Flat or sectioned TOML -> {"model": {...}, "train": {...}}; unknown keys are errors."""
    known = {section: {f.name: typ for s, f, typ in _fields() if s == section} for section in ("model", "train")}
    out: dict[str, dict] = {"model": {}, "train": {}}
    flat, shown = {}, {}
    for key, value in data.items():
        if key in ("model", "train") and isinstance(value, dict):
            for k, v in value.items():
                flat[(key, k.replace("-", "_"))] = v
                shown[(key, k.replace("-", "_"))] = f"{key}.{k}"
        elif key == "preset":
            out["preset"] = value
        else:
            name = key.replace("-", "_")
            section = "model" if name in known["model"] else "train"
            flat[(section, name)] = value
            shown[(section, name)] = key
    unknown = [shown[(s, k)] for (s, k) in flat if k not in known[s]]
    if unknown:
        raise ValueError(f"--config {path}: unknown keys {unknown}; see train_ddp.py --help for the fields")
    for (section, name), value in flat.items():
        typ = known[section][name]
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if typ is int_or_auto:
            typ = int if value != "auto" else str
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise ValueError(f"--config {path}: {name} = {value!r} should be of type {typ.__name__}")
        out[section][name] = value
    return out


def parse_config(argv: list[str] | None = None) -> RunConfig:
    """Parse the command line into a validated RunConfig (raises SystemExit(2) on bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return resolve(args)
    except ValueError as e:
        parser.exit(2, f"train_ddp.py: error: {e}\n")


def resolve(args: argparse.Namespace) -> RunConfig:
    file_values = _split_file_values(load_toml(args.config), args.config) if args.config else {}
    preset = args.preset or file_values.pop("preset", None)
    if preset is not None and preset not in MODEL_PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(MODEL_PRESETS)}")
    values = {"model": {}, "train": {}}
    if preset:
        values["model"].update(MODEL_PRESETS[preset])
        values["train"].update(TRAIN_PRESETS.get(preset, {}))
    for section in ("model", "train"):
        values[section].update(file_values.get(section, {}))
    for key, value in vars(args).items():
        if "." in key and value is not None:
            section, name = key.split(".", 1)
            values[section][name] = value
    model = ModelConfig(**values["model"])
    train = TrainConfig(**values["train"])
    missing = [flag for flag, v in (("--data-dir", train.data_dir), ("--out-dir", train.out_dir)) if not v]
    if missing:
        raise ValueError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required")
    return RunConfig(model, train)
