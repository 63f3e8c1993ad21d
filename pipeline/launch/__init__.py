"""`asyncrl run`: one machine, one broker, one process per worker, one run directory.

The launcher starts a fork server that imports the workers' code meanwhile, starts the
embedded broker unless a bootstrap is configured, prepares the model (the demo builds and
warms up its own) and config.yaml, then forks the workers from that server, each a
process as if started as `asyncrl worker <role>` (`pipeline.forkserver`); from the
trainer's first step it starts the held-out evaluator (`workers.evaluator.worker`, on idle
cores only), follows `metrics.jsonl` for the
progress bar and asks for evaluations, and stops everything when the trainer has made its
last step, on Ctrl-C or SIGTERM, when the embedded broker dies, or after `max_wall_s`.
`asyncrl run --resume RUN_DIR` starts a stopped, failed or killed run again from its
newest checkpoint; on the embedded broker its topics come back from `topics.export`,
which the trainer appends to before each checkpoint.

`run_dir` (the run directory made and checked, `prepare`), `worker_processes`, `stop_signals`, `local_run`
(what a run started, in order; `run_pipeline`), `resume` (what a run resumes from; the run directory's lock).
"""

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # workers are processes already
