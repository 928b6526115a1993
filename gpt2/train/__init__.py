"""A training run: the command line (cli.py), start-up checks (startup.py), the rehearsal (dryrun.py),
the loop (trainer.py), what a checkpoint holds (state.py), optimizers (optim.py, muon.py), evaluation
(scoring.py) and the metrics log (metrics.py). Only train_ddp.py and the tools' ladder import the loop."""
