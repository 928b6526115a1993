"""GPT-2 pretraining library: model, config, data, distributed training, checkpoints.

Importing this package has no side effects; each module is imported on demand.
"""

__version__ = "0.1.0"
