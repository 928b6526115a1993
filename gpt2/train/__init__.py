"""A training run: the command line (cli.py), start-up checks (startup.py), the rehearsal (dryrun.py),
the loop (trainer.py), what a checkpoint holds (state.py), optimizers (optim.py, muon.py), evaluation
(scoring.py) and the run's log (run_log.py: the console, train.log, metrics.jsonl). Only train_ddp.py
and the doctor's acceleration ladder import the loop."""
