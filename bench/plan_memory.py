"""The memory plan against a CPU training step's resident peak, with glibc's default malloc and with the
setting a CPU run makes (gpt2.core.host_memory.return_freed_memory), and the CPU time each costs.

    python bench/plan_memory.py            # the default grid: 2 x 64 wide, block 64, eager, fp32 and bf16
    python bench/plan_memory.py --steps 3 --compiled

Each row runs in fresh processes (gpt2.plan.measure.resident_training_peak: the growth of the resident set
over a few AdamW steps, above a warm-up of a tiny model on the same paths), once per malloc setting, and
prints the plan's total (gpt2/plan/memory.py), each measured peak and its ratio to the plan, and the CPU
seconds per step (user + system) of the measured steps. Prints one table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpt2.core.config import ModelConfig  # noqa: E402
from gpt2.core.precision import Precision  # noqa: E402
from gpt2.plan.hardware import device_hardware  # noqa: E402
from gpt2.plan.memory import memory, run_config  # noqa: E402

CHILD = """
import json, resource, sys
from gpt2.core.config import ModelConfig
from gpt2.core.precision import Precision
from gpt2.plan.measure import resident_training_peak
a = json.loads(sys.argv[1])
r0 = resource.getrusage(resource.RUSAGE_SELF)
peak = resident_training_peak(ModelConfig(**a["cfg"]), a["B"], prec=Precision.from_key(a["dtype"]), loss_impl=a["loss"],
                              compiled=a["compiled"], steps=a["steps"], tuned_malloc=a["tuned"])
r1 = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps([peak, r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime]))
"""

GRID = [  # (n_embd, micro-batch, dtype, loss)
    (64, 32, "fp32", "full"),
    (64, 64, "fp32", "chunked"),
    (64, 512, "fp32", "chunked"),
    (64, 64, "bf16", "chunked"),
    (256, 64, "fp32", "chunked"),
]


def run(cfg: ModelConfig, B: int, dtype: str, loss: str, compiled: bool, steps: int, tuned: bool) -> tuple[int, float]:
    arg = {
        "cfg": {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd, "block_size": cfg.block_size},
        "B": B,
        "dtype": dtype,
        "loss": loss,
        "compiled": compiled,
        "steps": steps,
        "tuned": tuned,
    }
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(arg)], capture_output=True, text=True, check=True)
    return tuple(json.loads(out.stdout.splitlines()[-1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--compiled", action="store_true", help="torch.compile the model (minutes per row)")
    ap.add_argument("--rows", type=int, default=len(GRID), help="the first N rows of the grid")
    args = ap.parse_args(argv)
    print(
        "| width x micro-batch | dtype | loss | plan MiB | default malloc MiB (x plan) | returned MiB (x plan) "
        "| CPU s/step default | returned |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for h, B, dtype, loss in GRID[: args.rows]:
        cfg = ModelConfig(n_layer=2, n_head=max(1, h // 32), n_embd=h, block_size=64)
        run_cfg = run_config(cfg, B, prec=Precision.from_key(dtype), loss_impl=loss, compile=args.compiled)
        plan = memory(run_cfg, device_hardware("cpu", None)).total
        (d, dt), (t, tt) = (run(cfg, B, dtype, loss, args.compiled, args.steps, tuned) for tuned in (False, True))
        # cpu seconds include the warm-up's (small beside the steps here); per step:
        print(
            f"| {h} x {B} | {dtype} | {loss} | {plan / 2**20:,.0f} | {d / 2**20:,.0f} ({d / plan:.2f}) | "
            f"{t / 2**20:,.0f} ({t / plan:.2f}) | {dt / args.steps:.2f} | {tt / args.steps:.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
