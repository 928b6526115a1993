"""The train_ddp.py flag lists that two or more bench scripts share.

Each is written as the command line it is, one string of flags split on its spaces, so a reader sees a
command (a list literal, ruff format spells out one string per line); no value here holds a space. A script
adds its own flags around one, e.g. bench/time_to_loss.py's `["--device", "cpu", *QUIET_RUN, "--log-interval",
"1000"]`. The lists are shared: a script that changes flags changes a copy, never one of these in place.

This module imports nothing (bench/gpu_session.py, which must not import torch, reads it too). The scripts
import it as they import their other siblings: `from flags import ...` (a script's directory is on sys.path;
the tests that import a script put bench/ there).
"""

NO_OUTPUTS = "--sample-interval 0 --ckpt-interval 0 --plot false".split()
"""No samples, no periodic checkpoints, no plot."""

QUIET_RUN = "--eval-interval 0 --eval-tokens 0 --sample-interval 0 --ckpt-interval 0 --plot false".split()
"""No evaluation either: a run that only trains."""

NANOGPT_SHAPE = (
    "--n-layer 4 --n-head 4 --n-embd 128 --block-size 64 --micro-batch-size 16 --total-batch-size 1024".split()
)
"""nanoGPT's small Shakespeare shape: 4 layers, 4 heads, 128 wide, block 64, batch 16 (1,024 tokens a step)."""

NANOGPT_LR = "--lr 1e-3 --min-lr 1e-4 --warmup-steps 20".split()
"""nanoGPT's learning rate there: 1e-3 warmed up over 20 steps, then cosine to 1e-4."""

NANOGPT_ADAMW = "--beta1 0.9 --beta2 0.95 --weight-decay 0.1 --grad-clip 1.0".split()
"""nanoGPT's AdamW: betas 0.9/0.95, weight decay 0.1, gradient clip 1.0."""

PARITY_STEPS = 200
PARITY = [
    *NANOGPT_SHAPE,
    *NANOGPT_LR,
    "--max-steps",
    str(PARITY_STEPS),
    *NANOGPT_ADAMW,
    *"--compile false --dtype float32 --data-order shuffled".split(),
]
"""The learning-parity recipe: nanoGPT's small Shakespeare run over PARITY_STEPS steps, eager, fp32, shuffled
(bench/time_to_loss.py's RECIPE, bench/spike_stat.py's clean run)."""

W1_SHAPE = "--n-layer 6 --n-head 6 --n-embd 384 --block-size 256 --micro-batch-size 8 --total-batch-size 2048".split()
"""6 layers x 384 (6 heads, nanoGPT's shakespeare_char model), block 256, 8 x 256 tokens a step: bench/vs_nanogpt.py's
W1, bench/time_to_loss.py's --shape large, bench/optimizers.py's medium."""

SMOKE_SHAPE = "--n-layer 2 --n-head 2 --n-embd 64 --block-size 32 --total-batch-size 256".split()
"""bench/vs_nanogpt.py's smoke shape (bench/gpu_session.py --cpu-smoke): tiny, the micro-batch left to auto."""
