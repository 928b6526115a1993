"""What survives a process: checkpoint files (checkpoint.py), the background writer (writer.py), sharded
checkpoints (dcp.py), where to resume (resume.py), the run directory and its lock (rundir.py), and
loading a model from any of them or from Hugging Face (load.py)."""
