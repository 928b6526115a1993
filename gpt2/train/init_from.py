"""--init-from: a new run that starts from trained weights (TrainConfig.ckpt.init_from).

The step, optimizer state, schedule, data position and run id start fresh; only the weights come
from the source, and the model's shape with them. Three kinds of source, told apart by the path:
  - a Hugging Face GPT-2 directory: config.json (model_type gpt2, GPT-2's 50,257-token vocabulary) and
    model.safetensors (or its index, or pytorch_model.bin), as `python -m gpt2.export` writes it or
    OpenAI's save_pretrained layout; the embedding is zero-padded to our 50,304 rows (gpt2/model/hf.py);
  - a hub name (gpt2, gpt2-medium, gpt2-large, gpt2-xl) that is not a directory with a config.json
    here (pass ./gpt2 for such a directory): downloaded into the Hugging Face cache by huggingface_hub
    (the [hf] extra), config.json when the command line is read, the weights by rank 0 at start-up;
  - one of our checkpoints: a step_*.pt file, a sharded step_*/ directory, or a run directory (or its
    checkpoints/): its newest checkpoint with a sidecar and the right size, verified (sha256) as it loads.

Two moments:
  1. describe_source(spec), when the command line is parsed (every rank; --dry-run too): the source's shape,
     from config.json or the checkpoint's recorded config, without reading the weights.
  2. start_from_weights(), in build(): rank 0 alone reads the weights into the model it has just built
     and hashes the files for config.json's record. Hashing reads every byte once more: about a second
     per GB from a local disk (gpt2-xl's 6 GB: seconds to a minute), once, at start-up. Only rank 0
     holds the source in host memory, never each rank its own copy. The others get the weights by
     broadcast: under ddp, DDP itself broadcasts rank 0's parameters and buffers when it wraps the
     model (gpt2/train/trainer.py wrap_ddp); FSDP2's fully_shard keeps each rank's own values (no
     broadcast), so under fsdp they are broadcast here, tensor by tensor, before sharding.

A run directory that holds this run's own checkpoint resumes it (--resume auto): a requeued job whose
command line still says --init-from continues where it stopped, not from the source again.

The Hugging Face conversion (gpt2/model/hf.py) and the hub client are imported inside the functions
that use them: a run without --init-from imports neither (tests/test_architecture.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
import urllib.parse
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from gpt2.ckpt import checkpoint as ckpt
from gpt2.core.config import GPT2_VOCAB_SIZE, PADDED_VOCAB_SIZE, ModelConfig
from gpt2.distributed.group import Dist, collective, rank0_decides

HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
HUB_REPO = "openai-community/{}"
HUB_FILES = ["config.json", "model.safetensors"]
KINDS = (
    "a Hugging Face GPT-2 directory (python -m gpt2.export's --out), a step_*.pt checkpoint, a sharded "
    f"step_*/ checkpoint, a run directory, or a hub name ({', '.join(HUB_NAMES)})"
)


@dataclass(frozen=True)
class Source:
    """Where --init-from's weights are, and the model shape they have (read without the weights)."""

    spec: str
    """--init-from as given."""
    kind: str
    """"hf" (a Hugging Face directory, downloaded or not) or "checkpoint" (ours)."""
    path: str
    """The directory (hf) or the checkpoint file / sharded directory."""
    shape: dict = field(default_factory=dict)
    """ModelConfig.shape_fields' values."""
    step: int | None = None
    """A checkpoint's training step."""
    hub: str | None = None
    """The hub repository, for a hub name."""

    def describe(self) -> str:
        shape = " ".join(f"{k}={self.shape[k]}" for k in ("n_layer", "n_head", "n_embd", "block_size"))
        what = (
            f"hub {self.hub} (cached in {self.path})"
            if self.hub
            else f"Hugging Face directory {self.path}"
            if self.kind == "hf"
            else f"checkpoint {self.path} (step {self.step})"
        )
        return f"{what}: {shape}"


def describe_source(spec: str) -> Source:
    """The source --init-from names, and its shape; ValueError (one line) saying what is wrong."""
    path = Path(spec)
    if spec in HUB_NAMES and not (path / "config.json").is_file():
        return _hub_source(spec)
    if not path.exists():
        raise ValueError(f"--init-from {spec}: no such file or directory; pass {KINDS}")
    if ckpt.is_checkpoint(path):
        return _checkpoint_source(spec, path)
    if path.is_dir() and ((path / "checkpoints").is_dir() or path.name == "checkpoints"):
        run_dir = path.parent if path.name == "checkpoints" else path
        newest = next((p for p in ckpt.list_checkpoints(run_dir) if ckpt.looks_complete(p)), None)
        if newest is None:
            raise ValueError(
                f"--init-from {spec}: no complete checkpoint in {ckpt.checkpoint_dir(run_dir)}; "
                "pass a step_*.pt file or another run directory"
            )
        return _checkpoint_source(spec, newest)
    return _hf_source(spec, path)


def _checkpoint_source(spec: str, path: Path) -> Source:
    try:  # mmap: the tensors stay in the file; the config and step are read
        state = ckpt.load_checkpoint(path, verify=False, mmap=True)
    except ckpt.CheckpointError as e:
        raise ValueError(f"--init-from {spec}: {_one_line(e)}") from None
    if state.get("tokenizer") != "gpt2":
        raise ValueError(
            f"--init-from {spec}: trained with tokenizer {state.get('tokenizer')!r}; only the "
            "GPT-2 BPE ('gpt2') is supported"
        )
    saved = ModelConfig(**state["config"]["model"]).to_dict()  # options it predates: their defaults (off)
    return Source(
        spec, "checkpoint", str(path), {k: saved[k] for k in ModelConfig.shape_fields()}, step=int(state["step"])
    )


def _hf_source(spec: str, path: Path, *, weights_here: bool = True) -> Source:
    from gpt2.model import hf

    config = path / "config.json"
    if not config.is_file():
        raise ValueError(
            f"--init-from {spec}: {path} holds no config.json: not a Hugging Face GPT-2 directory, "
            f"a checkpoint or a run directory; pass {KINDS}"
        )
    try:
        cfg = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--init-from {spec}: {config} is unreadable ({_one_line(e)})") from None
    if not isinstance(cfg, dict) or cfg.get("model_type") != "gpt2":
        kind = cfg.get("model_type") if isinstance(cfg, dict) else None
        raise ValueError(
            f"--init-from {spec}: {config} describes a {kind!r} model, not GPT-2 (model_type "
            "'gpt2'); only GPT-2 weights fit this model"
        )
    if cfg.get("vocab_size") != GPT2_VOCAB_SIZE:
        raise ValueError(
            f"--init-from {spec}: {config} has vocab_size={cfg.get('vocab_size')}, GPT-2's tokenizer "
            f"{GPT2_VOCAB_SIZE}: the model was trained with another vocabulary, which our token shards "
            "do not use"
        )
    try:
        hf.check_hf_config(cfg, config)
        n_head = int(cfg["n_head"])
        shape = dict(
            n_layer=int(cfg["n_layer"]),
            n_head=n_head,
            n_kv_head=n_head,
            n_embd=int(cfg["n_embd"]),
            block_size=int(cfg["n_positions"]),
            vocab_size=PADDED_VOCAB_SIZE,
            bias=True,
        )
        # Every other shape field as GPT-2's layout has it (rope=False, a tied head, ...): an option given
        # with these weights is then a clash named at once, not a model their tensors do not fit.
        shape = {k: v for k, v in ModelConfig(**shape).to_dict().items() if k in ModelConfig.shape_fields()}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(
            f"--init-from {spec}: {_one_line(e) if isinstance(e, ValueError) else f'{config} lacks {e}'}"
        ) from None
    if weights_here and not _weight_files(path):
        raise ValueError(
            f"--init-from {spec}: {path} has a config.json but no weights (none of {', '.join(hf.WEIGHT_FILES)})"
        )
    return Source(spec, "hf", str(path), shape)


def _hub_source(name: str) -> Source:
    """A hub name: its config.json from the Hugging Face cache (downloaded if missing)."""
    config = _hub_download(name, ["config.json"])
    return replace(_hf_source(name, Path(config).parent, weights_here=False), hub=HUB_REPO.format(name))


def _hub_download(name: str, files: list[str]) -> str:
    """The local snapshot directory (or file) of hub GPT-2 `name` holding files; ValueError offline."""
    repo = HUB_REPO.format(name)
    fetch = (
        f'download it where there is a network: python -c "from huggingface_hub import snapshot_download; '
        f"snapshot_download('{repo}', allow_patterns={HUB_FILES}, local_dir='{name}-hf')\", copy that "
        f"directory here and pass --init-from {name}-hf"
    )
    try:
        import huggingface_hub
    except ImportError:
        raise ValueError(
            f"--init-from {name}: downloading from the Hugging Face hub needs huggingface_hub "
            f"(pip install 'gpt2-ddp[hf]'); or {fetch}"
        ) from None
    download, snapshot = huggingface_hub.hf_hub_download, huggingface_hub.snapshot_download  # imported now
    hub_log = logging.getLogger("huggingface_hub")  # its retry warnings: the error below says it in one line
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)
    try:
        if files == ["config.json"]:  # the cache first: a requeued job or a second node needs no network
            with contextlib.suppress(Exception):
                return download(repo, "config.json", local_files_only=True)
        unreachable = _hub_unreachable()
        if unreachable:
            raise ConnectionError(unreachable)
        return download(repo, "config.json") if files == ["config.json"] else snapshot(repo, allow_patterns=files)
    except Exception as e:  # noqa: BLE001 - offline, DNS, proxy, HTTP and cache errors differ by version
        why = str(e) if isinstance(e, ConnectionError) and str(e) else type(e).__name__
        raise ValueError(f"--init-from {name}: the Hugging Face hub is unreachable ({why}); {fetch}") from None
    finally:
        hub_log.setLevel(level)


HUB_PROBE_TIMEOUT_S = 3.0
"""A cluster node without a route out fails this connect at once or after it; huggingface_hub's own
retries take ~25 s to say the same."""


def _hub_unreachable() -> str | None:
    """Why the hub cannot be reached (HF_HUB_OFFLINE set, or no route to its host within HUB_PROBE_TIMEOUT_S), or
    None to let huggingface_hub try: also when a proxy decides the route, which it handles itself. HF_HUB_OFFLINE
    is read here, not left to huggingface_hub, which reads it once at its import: set after that (a notebook, a
    test), its retries took ~25 s to fail."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    host = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as e:
        return f"{host}:443: {e.strerror or type(e).__name__}"
    return None


def _weight_files(path: Path) -> list[Path]:
    """The weights files of a Hugging Face directory, in the order gpt2/model/hf.py prefers them."""
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError):
            return [index]
        return [index, *(path / s for s in shards)]
    return [path / "pytorch_model.bin"] if (path / "pytorch_model.bin").is_file() else []


def start_from_weights(
    model: torch.nn.Module, spec: str, point, out_dir: str, run_id: str | None, dist: Dist, log, *, broadcast: bool
) -> dict | None:
    """build()'s --init-from: the source's weights in `model` (raw, unwrapped, unsharded) on every rank,
    or nothing when the run resumes its own checkpoint (point: choose_start's; not None). Returns the
    record config.json keeps (on rank 0; None elsewhere). broadcast: send rank 0's weights to the
    other ranks here (fsdp, whose sharding does not); ddp's wrap does it.
    """
    if point is not None:
        log.info(
            f"init from  --init-from {spec} not read: this run resumes its own checkpoint {point.path} "
            f"(step {point.step}); it began from {spec}"
        )
        return earlier_record(out_dir, run_id) if dist.is_main else None

    def load() -> dict:
        t0 = time.perf_counter()
        try:
            record = _load(model, describe_source(spec))
        except (ValueError, OSError, RuntimeError, KeyError) as e:  # CheckpointError is a ValueError
            line = _one_line(e)
            raise ValueError(line if line.startswith("--init-from") else f"--init-from {spec}: {line}") from None
        log.info(
            f"init from  {record['source']} | rank 0 read and hashed {record['bytes'] / 2**30:.2f} GiB in "
            f"{time.perf_counter() - t0:.1f} s; step, optimizer, schedule and data position start fresh"
        )
        return record

    record = rank0_decides(load, dist, errors=(ValueError,))
    if broadcast and dist.is_distributed:
        broadcast_weights(model, dist)
    return record if dist.is_main else None


def broadcast_weights(model: torch.nn.Module, dist: Dist) -> None:
    """Rank 0's parameters and buffers on every rank, one tensor at a time (no second copy of the model)."""
    import torch.distributed as tdist

    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}  # the tied LM head once
    with collective("--init-from's broadcast of rank 0's weights"), torch.no_grad():
        for t in tensors.values():
            tdist.broadcast(t.data, src=0)


def _load(model: torch.nn.Module, source: Source) -> dict:
    """The source's weights into model (rank 0); the record of where they came from."""
    have = {k: getattr(model.config, k) for k in source.shape}
    if have != source.shape:  # a run directory whose newest checkpoint changed since the command line was read
        raise ValueError(f"the weights' shape {source.shape} is not this run's {have}")
    if source.kind == "checkpoint":
        return _load_checkpoint(model, source)
    return _load_hf(model, source)


def _load_checkpoint(model: torch.nn.Module, source: Source) -> dict:
    from gpt2.ckpt import dcp as dcp_io

    path = Path(source.path)
    ckpt.verify_checkpoint(path)  # the sha256 its sidecar records, and so config.json records
    meta = ckpt.checkpoint_meta(path)  # the sidecar, or the fields of a .pt that lost it (verified above)
    state = ckpt.load_checkpoint(path, verify=False, mmap=True)
    if state.get("sharded"):
        dcp_io.load_weights(model, path, no_dist=True)  # rank 0 alone: no collective
    else:
        model.load_state_dict(state["model"])
    files = meta.get("files") or {path.name: {"bytes": meta["bytes"], "sha256": meta["sha256"]}}
    return {
        "spec": source.spec,
        "kind": "checkpoint",
        "path": str(path.resolve()),
        "step": source.step,
        "source": source.describe(),
        "sha256": meta["sha256"],
        "bytes": int(meta["bytes"]),
        "files": files,
        "run_id": ckpt.run_id_of(meta),
    }


def _load_hf(model: torch.nn.Module, source: Source) -> dict:
    from gpt2.model import hf

    directory = Path(source.path)
    if source.hub:  # rank 0 downloads the weights (cached: once per machine)
        directory = Path(_hub_download(source.spec, HUB_FILES))
    weights = _weight_files(directory)
    if not weights:
        raise ValueError(f"{directory} has no weights (none of {', '.join(hf.WEIGHT_FILES)})")
    sd = hf.read_weights(directory)
    shape, ours = hf.convert_hf_state_dict(sd, vocab_size=model.config.vocab_size)
    del sd
    wrong = [f"{k}={v} (config.json: {source.shape[k]})" for k, v in shape.items() if v != source.shape[k]]
    if wrong:
        raise ValueError(f"{directory}: the weights have {', '.join(wrong)}")
    try:
        hf.check_keys(model.state_dict(), ours)
    except ValueError as e:
        raise ValueError(_one_line(e)) from None
    with torch.no_grad():
        model.load_state_dict(ours)
    files = {}
    for f in [directory / "config.json", *weights]:
        files[f.name] = {"bytes": f.stat().st_size, "sha256": ckpt.file_sha256(f)}
    main = files[weights[-1].name] if len(weights) == 1 else None
    return {
        "spec": source.spec,
        "kind": "hf",
        "path": str(directory.resolve()),
        "hub": source.hub,
        "source": source.describe(),
        "sha256": main["sha256"] if main else None,
        "bytes": sum(v["bytes"] for v in files.values()),
        "files": files,
    }


def earlier_record(out_dir: str, run_id: str | None) -> dict | None:
    """What config.json recorded of the weights this run began from (a resume keeps it)."""
    try:
        info = json.loads((Path(out_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return info.get("init_from") if isinstance(info, dict) and info.get("run_id") == run_id else None


def rehearsal_line(spec: str, resumed_step: int) -> str:
    """--dry-run's line: what --init-from would read, or that the run resumes its own checkpoint."""
    if resumed_step:
        return (
            f"init from  --init-from {spec} would not be read: the run resumes its own checkpoint (step {resumed_step})"
        )
    return (
        f"init from  {describe_source(spec).describe()}; rank 0 reads and hashes the weights at start-up (not now), "
        "step, optimizer, schedule and data position start fresh"
    )


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())
