"""The node check, `python -m gpt2.doctor` (its flags, output and exit status: __main__.py).

__main__.py           the command line: flags, which sections, doctor.json and doctor.txt, the exit status
sections.py           the sections in table order and run order, each run guarded
results.py            a section's rows and status, the exit status, the table and the JSON
context.py            what every section gets: device, scale of the checks, runs made so far
check_environment.py  devices, driver, CUDA, NCCL, bf16, compiler, --dtype auto
check_attention.py    which SDPA backend runs the model's attention (sdpa_probe.py finds out)
check_correctness.py  fast defaults against fp32 eager, and both resumed from their checkpoints
check_training.py     the gpt2 preset's tokens/s, MFU and memory; DDP across the local devices
check_ladder.py       the acceleration ladder's rungs (acceleration.py, which bench/ladder.py also runs)
train_runs.py         train_ddp.py runs on synthetic shards, and the comparisons between them
"""
