"""`asyncrl chaos` options: the standard library only, so that `asyncrl --help` stays instant."""

from __future__ import annotations

import argparse

KILL_ROLES = ("prompts", "rollout", "reward", "trainer", "launcher", "broker")


def add_parser(commands: argparse._SubParsersAction) -> None:
    chaos = commands.add_parser(
        "chaos",
        help="fault injection: SIGKILL each role at random moments of short runs, or --poison, then check each run",
        description="Short arith runs; in each, one role's process is SIGKILLed at random moments while the pipeline "
        "works (up to 3 per run: the launcher restarts a worker 3 times); launcher and broker kills are followed by "
        "`asyncrl run --resume` (only where this build has it). Each run is read back from its topics: no group "
        "lost, no trajectory trained twice, steps and versions 1..N, the run completed, no process left behind. "
        "With --poison: bad records on every topic and bad rows in the dataset of a running pipeline instead.",
    )
    chaos.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. trainer.max_staleness=0")
    chaos.add_argument("--roles", nargs="+", choices=KILL_ROLES, default=list(KILL_ROLES), help="roles to kill")
    chaos.add_argument("--trials", type=int, default=20, help="SIGKILLs per role (default: %(default)s)")
    chaos.add_argument("--kills-per-run", type=int, default=3, help="at most 3 for a worker (default: %(default)s)")
    chaos.add_argument(
        "--resume-kills-per-run",
        type=int,
        default=5,
        help="launcher and broker: kills (each followed by a resume) per run (default: %(default)s)",
    )
    chaos.add_argument("--steps", type=int, help="trainer steps per run (default: 60; --poison: 120)")
    chaos.add_argument(
        "--minutes",
        type=float,
        default=60,
        help="kills: time budget, shared out among the roles (default: %(default)s)",
    )
    chaos.add_argument("--seed", type=int, default=0, help="kill moments, poison and rows (default: %(default)s)")
    chaos.add_argument("--out", default="runs/chaos", help="runs, JSON and plot go here (default: %(default)s)")
    chaos.add_argument("--no-progress", action="store_true", help="no progress bar")
    chaos.add_argument("--poison", action="store_true", help="poison a running pipeline instead of killing roles")
    chaos.add_argument(
        "--messages", type=int, default=10_000, help="--poison: randomised records (default: %(default)s)"
    )
    chaos.add_argument("--bad-rows", type=int, default=300, help="--poison: bad dataset rows (default: %(default)s)")
    chaos.add_argument(
        "--no-clean", action="store_true", help="--poison: no clean run to compare accuracy with (and no warm-up)"
    )
    chaos.add_argument(
        "--skip-kind",
        action="append",
        default=[],
        metavar="TEXT",
        help="--poison: leave out the kinds whose name holds TEXT, e.g. 'n_samples differs' (repeatable)",
    )
    chaos.set_defaults(handle=handle)


def handle(args: argparse.Namespace) -> int:
    from pipeline.chaos.command import chaos_command

    return chaos_command(args)
