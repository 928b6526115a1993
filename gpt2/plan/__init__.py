"""Before a run: FLOPs and MFU (flops.py), memory per device (memory.py), the hardware (hardware.py), the
loss path (loss_choice.py), the stop budget (budget.py), the Plan (planner.py) and its report; the
command `python -m gpt2.plan` is __main__.py."""
