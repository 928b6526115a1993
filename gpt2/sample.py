"""Text from a trained model: `python -m gpt2.sample --checkpoint RUN [--prompt TEXT] ...`.

Loads one of our checkpoints (a step_*.pt file, a run directory or its checkpoints/ directory: the
newest valid checkpoint) or a local Hugging Face GPT-2 directory (config.json + weights), then
generates with the KV cache and prints text as each token arrives.

A prompt longer than the model's block_size is an error, not a silent truncation: the model would
not see the start of the text the user wrote. Generation itself may run past block_size (the
context window slides over the last block_size tokens, as GPT.generate does).

A sample ends at the first <|endoftext|> (token 50256) it draws, as the model's text does: the token
is not printed, and generation stops there rather than running on to --max-new-tokens.

Samples are drawn one after another from one seeded generator, so the CLI and `sample()` print
the same text for the same seed.
"""

from __future__ import annotations

import argparse
import codecs
import sys
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from gpt2.core import precision
from gpt2.core.args import OneLineParser, one_line_notes
from gpt2.core.config import EOT_TOKEN, GPT2_VOCAB_SIZE
from gpt2.model.gpt import GPT, TOP_K, unwrap
from gpt2.model.tokenizer import encode_prompt, get_encoding
from gpt2.plan import precision_choice


def sampling_autocast(dtype: str, device: torch.device):
    """Autocast for a dtype name, auto included (gpt2.plan.precision_choice picks what the device runs fast)."""
    return precision_choice.resolve_precision(dtype, device).autocast(device)  # the command line's string, parsed here


@torch.no_grad()
def stream_tokens(
    model: GPT,
    idx: Tensor,
    max_new_tokens: int,
    *,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator | None,
) -> Iterator[Tensor]:
    """Yield each new (B,) token as GPT.generate would append it (same tokens for the same RNG), up to
    and including the end-of-text token once every row has drawn it (a row that ended repeats it).

    GPT.generate returns only when done; GPT.generate_stream is the same KV-cache loop as a
    generator, so text can be shown while the model works.
    """
    for next_tok in unwrap(model).generate_stream(
        idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator, stop_token=EOT_TOKEN
    ):
        yield next_tok[:, 0]


class TextStream:
    """Token ids in, text out as soon as it is complete UTF-8.

    One GPT-2 token can hold part of a character (an emoji is often 2-3 byte-level tokens), so the
    bytes of a token are not always decodable alone: an incremental UTF-8 decoder holds them back
    until the character is complete. Concatenated output equals tokenizer.decode of all tokens.
    """

    def __init__(self) -> None:
        self._enc = get_encoding()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        if not 0 <= token < GPT2_VOCAB_SIZE:  # padded-vocab rows are never sampled; be safe anyway
            return ""
        return self._decoder.decode(self._enc.decode_single_token_bytes(token))

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)


def sample(
    model: GPT,
    prompt: str = "",
    *,
    num_samples: int = 1,
    max_new_tokens: int = 100,
    temperature: float = 1.0,
    top_k: int | None = TOP_K,
    seed: int = 1337,
    dtype: str = "auto",
    on_text: Callable[[int, str], None] | None = None,
) -> list[str]:
    """Generate num_samples continuations of prompt; return their text (without the prompt), each
    ending before its first <|endoftext|>.

    temperature=0 is greedy. For streaming, on_text(i, piece) is called with "" when sample i
    starts and then with each piece of its text as it is decoded. Runs on the model's device; the
    global RNG state is untouched (a generator seeded with `seed` draws every sample).
    """
    problems = _sampling_problems(num_samples, max_new_tokens, temperature, top_k)
    if problems:
        raise ValueError("; ".join(problems))
    model = unwrap(model)
    device = model.lm_head.weight.device
    ids = encode_prompt(prompt, model.config.block_size)
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    texts = []
    try:
        with sampling_autocast(dtype, device):
            for i in range(num_samples):
                idx = torch.tensor([ids], dtype=torch.long, device=device)
                stream, pieces = TextStream(), []
                if on_text is not None:
                    on_text(i, "")
                tokens = stream_tokens(
                    model, idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator
                )
                for tok in tokens:
                    if int(tok) == EOT_TOKEN:  # the sample's end: not shown as text
                        break
                    pieces.append(stream.push(int(tok)))
                    if on_text is not None and pieces[-1]:
                        on_text(i, pieces[-1])
                pieces.append(stream.flush())
                if on_text is not None and pieces[-1]:
                    on_text(i, pieces[-1])
                texts.append("".join(pieces))
    finally:
        model.train(was_training)
    return texts


def _sampling_problems(num_samples, max_new_tokens, temperature, top_k) -> list[str]:
    p = []
    if num_samples < 1:
        p.append(f"num_samples={num_samples} must be >= 1")
    if max_new_tokens < 0:
        p.append(f"max_new_tokens={max_new_tokens} must be >= 0")
    if temperature < 0:
        p.append(f"temperature={temperature} must be >= 0 (0 is greedy)")
    if top_k is not None and top_k < 1:
        p.append(f"top_k={top_k} must be >= 1 (or omitted for no top-k filtering)")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m gpt2.sample",
        allow_abbrev=False,
        description="Sample text from a checkpoint or a Hugging Face GPT-2 directory.",
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="step_*.pt file, run directory (newest valid checkpoint), or Hugging Face directory",
    )
    parser.add_argument("--prompt", default="", help="text to continue (default: start from <|endoftext|>)")
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy decoding")
    parser.add_argument("--top-k", type=int, default=TOP_K, help="sample from the k likeliest tokens; 0 disables")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--dtype",
        choices=precision.DTYPES,
        default="auto",
        help="autocast dtype (auto: what this device runs fast, see gpt2/plan/precision_choice.py)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with one_line_notes("gpt2.sample"):  # e.g. a checkpoint that lost its sidecar: one line, not a UserWarning
        return run_sample(args)


def run_sample(args: argparse.Namespace) -> int:
    """main after parsing: load the model, then stream the samples; 2 for a user error (one line)."""
    from gpt2.ckpt.load import load_any
    from gpt2.distributed.group import resolve_device
    from gpt2.model.hf import MissingExtraError

    top_k = args.top_k or None
    try:  # everything the user can get wrong, before any generation
        problems = _sampling_problems(args.num_samples, args.max_new_tokens, args.temperature, top_k)
        if problems:
            raise ValueError("; ".join(problems))
        device = resolve_device(args.device, 0)
        model, info = load_any(args.checkpoint, device)
        encode_prompt(args.prompt, model.config.block_size)
    except (ValueError, MissingExtraError) as e:  # MissingExtraError: a Hugging Face directory without safetensors
        print(f"gpt2.sample: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    step = f" step {info['step']}" if "step" in info else ""
    print(
        f"loaded {info['source']}{step} from {info['path']}: {model.num_params():,} parameters on {device}",
        file=sys.stderr,
    )
    separator = "\n" + "-" * 40

    def show(i: int, piece: str) -> None:
        if not piece:  # sample i starts
            print((separator + "\n" if i else "") + args.prompt, end="", flush=True)
        print(piece, end="", flush=True)

    sample(
        model,
        args.prompt,
        num_samples=args.num_samples,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=top_k,
        seed=args.seed,
        dtype=args.dtype,
        on_text=show,
    )
    print(separator, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
