"""The argument parser every command shares (train_ddp.py, sample, eval, export, plan, doctor, metrics): its
errors are one line, and a mistyped flag gets the flag it probably meant; a tool's warnings as one-line notes."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import sys
import warnings


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line, `PROG: error: MESSAGE`, without the usage dump (train_ddp.py's
    runs to 26 lines, burying the error), and whose unknown flags get the likeliest meant one:
    `unrecognized argument --max_steps; did you mean --max-steps?`. train_ddp.py and the tools use it.
    PROG drops a leading `python -m ` (`gpt2.export: error: ...`, as the tools word their other errors)."""

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unrecognized(extras, self.option_names()))
        return parsed

    def error(self, message: str):
        self.exit(2, f"{self.prog.removeprefix('python -m ')}: error: {message}\n")

    def option_names(self) -> list[str]:
        """Every --flag of this parser and of its subcommands."""
        names = []
        for action in self._actions:
            names += [o for o in action.option_strings if o.startswith("--")]
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    names += sub.option_names() if isinstance(sub, OneLineParser) else []
        return sorted(set(names))


def unrecognized(extras: list[str], options: list[str]) -> str:
    """What an unknown flag was probably meant to be (underscores read as dashes, then the closest
    spelling), or where the flags are listed."""
    flags = [e.split("=", 1)[0] for e in extras if e.startswith("-")]
    if not flags:
        return f"unrecognized argument(s) {' '.join(extras)}"
    parts = []
    for flag in flags:
        dashed = "--" + flag.lstrip("-").replace("_", "-")
        close = [dashed] if dashed in options else difflib.get_close_matches(dashed, options, n=1, cutoff=0.6)
        parts.append(f"unrecognized argument {flag}" + (f"; did you mean {close[0]}?" if close else ""))
    if not any("did you mean" in p for p in parts):
        parts.append("--help lists the flags")
    return "; ".join(parts)


@contextlib.contextmanager
def one_line_notes(tool: str):
    """Warnings raised inside (ours, e.g. a checkpoint that lost its sidecar, or a library's) printed as
    the tool's own line, `gpt2.sample: note: MESSAGE` on stderr, instead of Python's `FILE:LINE: UserWarning:
    MESSAGE` followed by the source line that raised it, which reads like a crash to a user."""

    def note(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"{tool}: note: {' '.join(str(message).split())}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.showwarning = note
        yield
