"""What a run's start-up walks through before its first step: the project's modules and functions entered,
how often the call moves from one module to another, and the round trips between the trainer and the
start-up (issue 55's before/after, in docs/architecture.md).

    python bench/startup_trace.py --data-dir .gpu/data [-- more train_ddp.py flags]

Runs train_ddp.py in this process (--preset debug, one process, CPU, 1 step, a fresh --out-dir) under
sys.setprofile and stops counting at the first call of the trainer's train_step. Counted: functions
defined in gpt2/ or train_ddp.py (Python's own calls, torch's and numpy's are not; nor the bodies of
modules and classes that an import runs), each function once;
a "switch" is a call whose caller is in another of the project's modules; a "round trip" is a switch
from gpt2/train/trainer.py into gpt2/train/startup.py after the first one (the trainer handing the
start-up's order back and forth); the "call depth" is the longest chain of the project's own functions on the
stack at any call (main > run > ... > the deepest helper; comprehensions and lambdas are not counted), printed
with --deepest.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAINER, STARTUP = "gpt2.train.trainer", "gpt2.train.startup"


def module_of(filename: str) -> str | None:
    """The project's module a code object's file is, or None (the standard library, torch, ...)."""
    path = Path(filename)
    if path == REPO / "train_ddp.py":
        return "train_ddp"
    try:
        rel = path.relative_to(REPO / "gpt2")
    except ValueError:
        return None
    return ".".join(("gpt2", *rel.with_suffix("").parts)).removesuffix(".__init__")


class Trace:
    """Calls into the project's code up to the first train_step."""

    def __init__(self) -> None:
        self.functions: Counter[tuple[str, str]] = Counter()
        self.switches = 0
        self.trainer_to_startup = 0
        self.done = False
        self.deepest: list[str] = []

    def __call__(self, frame, event, arg) -> None:
        if self.done or event != "call":
            return
        module = module_of(frame.f_code.co_filename)
        if module is None:
            return
        if frame.f_code.co_name == "train_step" and module == TRAINER:
            self.done = True
            return
        if not frame.f_code.co_flags & inspect.CO_OPTIMIZED:
            return  # a module's or a class's body, run by an import: not the start-up's work
        self.functions[(module, frame.f_code.co_qualname)] += 1
        self._measure_depth(frame)
        caller = frame.f_back
        while caller is not None and module_of(caller.f_code.co_filename) is None:
            caller = caller.f_back  # through torch's and the standard library's frames
        source = None if caller is None else module_of(caller.f_code.co_filename)
        if source is not None and source != module:
            self.switches += 1
            if source == TRAINER and module == STARTUP:
                self.trainer_to_startup += 1

    def _measure_depth(self, frame) -> None:
        chain = []
        while frame is not None:
            module = module_of(frame.f_code.co_filename)
            if module is not None and not frame.f_code.co_name.startswith("<"):
                chain.append(f"{module.rsplit('.', 1)[-1]}.{frame.f_code.co_name}")
            frame = frame.f_back
        if len(chain) > len(self.deepest):
            self.deepest = chain[::-1]

    @property
    def modules(self) -> list[str]:
        return sorted({m for m, _ in self.functions})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--list", action="store_true", help="print the modules and their functions")
    p.add_argument("--deepest", action="store_true", help="print the deepest chain of the project's calls")
    p.add_argument("extra", nargs="*", help="more train_ddp.py flags (after --)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import train_ddp

    out = tempfile.mkdtemp(prefix="startup-trace-")
    flags = ["--preset", "debug", "--data-dir", args.data_dir, "--out-dir", out, "--max-steps", "1", "--device", "cpu"]
    trace = Trace()
    sys.setprofile(trace)
    try:
        train_ddp.main(flags + args.extra)
    finally:
        sys.setprofile(None)
    if not trace.done:
        print("the run ended before its first step: nothing measured", file=sys.stderr)
        return 1
    print("| before the first step | count |\n|---|---:|")
    print(f"| modules entered | {len(trace.modules)} |")
    print(f"| functions entered | {len(trace.functions)} |")
    print(f"| module switches | {trace.switches} |")
    print(f"| trainer -> start-up calls | {trace.trainer_to_startup} |")
    print(f"| call depth | {len(trace.deepest)} |")
    if args.deepest:
        print(" > ".join(trace.deepest))
    if args.list:
        for m in trace.modules:
            names = sorted(f for mod, f in trace.functions if mod == m)
            print(f"{m} ({len(names)}): {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
