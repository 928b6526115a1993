"""Train GPT-2 on one process or many.

    torchrun --standalone --nproc_per_node=8 train_ddp.py --preset gpt2 --data-dir DIR --out-dir RUN
    python train_ddp.py --preset debug --data-dir DIR --out-dir RUN --device cpu

Exit codes: 0 done, 1 failed, 2 bad configuration or data (nothing was started),
3 stopped by SIGTERM/SIGUSR1 after writing a checkpoint (requeue; --resume auto continues).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from gpt2.checkpoint import CheckpointError
    from gpt2.cli import parse_config
    from gpt2.dist import resolve_device, setup, teardown, world_from_env
    from gpt2.shards import ShardError
    from gpt2.trainer import check_data, train

    cfg = parse_config(argv)  # exits 2 with a message on bad flags or values
    dist = None
    try:
        info = world_from_env()
        try:  # everything a user can get wrong is checked before the process group starts
            device = resolve_device(cfg.train.device, info.local_rank)
            shards = check_data(cfg, info.world_size)
        except (ValueError, ShardError) as e:
            if info.rank == 0:
                print(f"train_ddp.py: error: {e}", file=sys.stderr)
            return 2
        dist = setup(info, device, cfg.train.dist_timeout_s)
        return train(cfg, dist, shards)
    except CheckpointError as e:
        print(f"train_ddp.py: error: {e}", file=sys.stderr)
        return 2
    finally:
        teardown(dist)


if __name__ == "__main__":
    sys.exit(main())
