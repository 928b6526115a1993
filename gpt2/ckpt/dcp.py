"""Model and optimizer state through torch.distributed.checkpoint (DCP): each rank reads and writes
its own shards, keyed by parameter name (FQN), so a checkpoint written by W ranks loads on any
number of ranks, sharded (FSDP) or not (DDP, one process, gpt2.sample/eval/export).

What DCP holds: {"model": the model's state dict, "optimizer": the optimizer's (FQN-keyed; Muon's
Optimizers pair as {"adamw": ..., "muon": ...})}. Everything small (config, step, loader, RNG,
scaler) is rank 0's train.pt beside it (gpt2/train/state.py); files, hashes and `latest` are
gpt2/ckpt/checkpoint.py's. The .pt checkpoints (DDP) keep torch's param-id keyed optimizer state:
`named_optimizer_state` converts it to names for a sharded run.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

# torch.distributed.checkpoint is imported where it is used: it is ~0.9 s of every process's start-up (it
# brings torch.distributed.tensor), and only sharded checkpoints need it.


def _checked(call, *args, **kwargs):
    """call(...) with DCP's CheckpointException (a BaseException, which `except Exception` misses)
    as a RuntimeError naming each failed rank's first line."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # one process without a process group is meant (load_weights)
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            return call(*args, **kwargs)
    except CheckpointException as e:
        failures = "; ".join(
            f"rank {r}: {type(x).__name__}: {' '.join(str(x).split())[:300]}"
            for r, (x, _trace) in sorted(e.failures.items())
        )
        raise RuntimeError(f"torch.distributed.checkpoint failed ({failures})") from None


TIED = {"lm_head.weight": "transformer.wte.weight"}
"""GPT-2's LM head is the token embedding (gpt2/model/gpt.py): a state dict names the one tensor twice,
and DCP would store it twice (a quarter of a small model's checkpoint). Saved once, under the
embedding's name; the head's entry is put back as the same tensor before loading. An untied head
(ModelConfig.tie_embeddings=False) is a tensor of its own, saved and loaded under its own name."""


def _tied(model: torch.nn.Module) -> bool:
    """Whether model's LM head is its token embedding (the raw or FSDP-sharded GPT; True for what has no config)."""
    return getattr(getattr(model, "config", None), "tie_embeddings", True)


def _untied(model_state: dict, tied: bool = True) -> dict:
    if not tied:
        return model_state
    return {k: v for k, v in model_state.items() if not (k in TIED and TIED[k] in model_state)}


def _retied(loaded: dict, wanted: dict) -> dict:
    return {**loaded, **{k: loaded[TIED[k]] for k in wanted if k in TIED and k not in loaded}}


def inner_optimizers(optimizer) -> dict[str | None, torch.optim.Optimizer]:
    """{name: torch optimizer}: gpt2/train/optim.py's Optimizers pair by name, a single one under None."""
    return dict(getattr(optimizer, "optimizers", None) or {None: optimizer})


def _per_inner(optimizer, value_of) -> dict:
    inner = inner_optimizers(optimizer)
    if list(inner) == [None]:
        return value_of(inner[None])
    return {name: value_of(o) for name, o in inner.items()}


def sharded_state(model: torch.nn.Module, optimizer) -> dict:
    """This rank's {"model", "optimizer"} state: DTensor shards under FSDP, whole tensors otherwise.
    (An optimizer without moments yet gets them initialised, as DCP's loading needs.)"""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {
        "model": _untied(get_model_state_dict(model), _tied(model)),
        "optimizer": _per_inner(optimizer, lambda o: get_optimizer_state_dict(model, o)),
    }


def save_dcp(model: torch.nn.Module, optimizer, directory: Path) -> None:
    """Every rank writes its shards into directory (DCP's files: __<rank>_0.distcp, .metadata by rank 0)."""
    import torch.distributed.checkpoint as dcp

    _checked(dcp.save, sharded_state(model, optimizer), checkpoint_id=str(directory))


def load(model: torch.nn.Module, optimizer, directory: Path) -> None:
    """Fill model and optimizer from directory: each rank reads the slices its shards cover (DCP
    reshards when the world size or the parallelism differs). Collective when a process group exists."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = sharded_state(model, optimizer)
    _checked(dcp.load, state, checkpoint_id=str(directory))
    set_model_state_dict(model, _retied(state["model"], model.state_dict()))
    inner = inner_optimizers(optimizer)
    for name, o in inner.items():
        set_optimizer_state_dict(model, o, state["optimizer"] if name is None else state["optimizer"][name])


def load_weights(model: torch.nn.Module, directory: Path, *, no_dist: bool = False) -> None:
    """A plain (unsharded) model's weights from directory, in one process (no process group): only
    the model's entries are read. no_dist: this process alone where a process group exists (rank 0 of
    --init-from, gpt2/train/init_from.py), not a collective of every rank."""
    import torch.distributed.checkpoint as dcp

    wanted = model.state_dict()
    state = {"model": _untied(wanted, _tied(model))}
    _checked(dcp.load, state, checkpoint_id=str(directory), **({"no_dist": True} if no_dist else {}))
    model.load_state_dict(_retied(state["model"], wanted))


def named_optimizer_state(saved: dict, model: torch.nn.Module, optimizer) -> dict:
    """A .pt checkpoint's optimizer state (torch's: parameters numbered in param_groups order) keyed
    by parameter name instead, for set_optimizer_state_dict. The numbering is this run's optimizer's:
    make_optimizer groups the same parameters in the same order for the same model and flags."""
    names = {id(p): n for n, p in model.named_parameters()}

    def named(one_saved: dict, o: torch.optim.Optimizer) -> dict:
        index = [names[id(p)] for g in o.param_groups for p in g["params"]]
        groups = [{**g, "params": [index[i] for i in g["params"]]} for g in one_saved["param_groups"]]
        return {"state": {index[i]: s for i, s in one_saved["state"].items()}, "param_groups": groups}

    inner = inner_optimizers(optimizer)
    if list(inner) == [None]:
        return named(saved, inner[None])
    return {name: named(saved["optimizers"][name], o) for name, o in inner.items()}


def load_full(model: torch.nn.Module, optimizer, model_state: dict, optimizer_state: dict) -> None:
    """Whole tensors (a .pt checkpoint, every rank holding them) into a sharded model and its
    optimizer: each rank keeps its slice. optimizer_state: named_optimizer_state's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=full)
    for name, o in inner_optimizers(optimizer).items():
        set_optimizer_state_dict(model, o, optimizer_state if name is None else optimizer_state[name], options=full)
