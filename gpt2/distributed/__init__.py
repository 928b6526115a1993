"""Several processes: the process group and collectives (group.py: Dist), FSDP (fsdp.py), the
interconnect probe (bandwidth.py), stop signals and preemption (preempt.py)."""
