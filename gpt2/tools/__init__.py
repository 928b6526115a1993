"""The node check's parts (`python -m gpt2.doctor`): its training runs (doctor_runs.py), the attention
probe (sdpa_probe.py) and the acceleration ladder (ladder.py)."""
