"""`asyncrl replay`: what a run's topics recorded, decoded, scored again or trained again (pipeline/replay.py)."""

from __future__ import annotations

import argparse

from pipeline.commands.topics import add_broker_options, reading_topics


def add_parser(commands: argparse._SubParsersAction) -> None:
    replay = commands.add_parser("replay", help="decode and show what a run's topics recorded")
    kinds = replay.add_subparsers(dest="what", required=True, metavar="{tail,trajectory,step,rescore,retrain}")
    tail = kinds.add_parser("tail", help="decode and print the messages of one topic")
    tail.add_argument(
        "topic", help="a topic role (prompts, segments, scored, weights, batches, dead-letter) or its name"
    )
    tail.add_argument(
        "--id", help="only messages with this id (prompt id, trajectory id, step, version, origin) or under it"
    )
    tail.add_argument("--from-offset", type=int, default=None, help="start every partition at this offset")
    tail.add_argument("--limit", type=int, default=None, help="the last N messages (the first N with --from-offset)")
    tail.add_argument("--json", action="store_true", help="one JSON object per line, nothing cut")
    trajectory = kinds.add_parser("trajectory", help="every attempt of one trajectory, each token with its version")
    trajectory.add_argument("trajectory_id", help="<prompt id>/<sample index>")
    step = kinds.add_parser("step", help="the manifest of one step: trajectories, rewards, staleness, dropped groups")
    step.add_argument("step", type=int)
    rescore = add_rescore_parser(kinds)
    retrain = kinds.add_parser(
        "retrain",
        help="train step N again from its manifest and the checkpoint before it; "
        "compare with the weights the run recorded (needs --config: checkpoints, weights)",
    )
    retrain.add_argument("--step", type=int, required=True, help="the step to rebuild")
    for kind in (tail, trajectory, step, rescore, retrain):
        add_broker_options(kind)
        kind.add_argument("--export", help="read an export file (asyncrl topics export) instead of a broker")
    replay.set_defaults(handle=handle)


def add_rescore_parser(kinds: argparse._SubParsersAction) -> argparse.ArgumentParser:
    rescore = kinds.add_parser(
        "rescore", help="score the recorded trajectories again with another reward function; show what changed"
    )
    rescore.add_argument("--reward", required=True, help="as data.reward: 'builtin', 'math' or 'module:function'")
    rescore.add_argument(
        "--processes", type=int, default=None, help="scoring processes (default: the config's reward.processes, else 1)"
    )
    rescore.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="per-call time limit in s (default: the config's reward.timeout_s, else 10)",
    )
    rescore.add_argument("--json", action="store_true", help="one JSON object: counts, mean rewards, every difference")
    return rescore


def handle(args: argparse.Namespace) -> int:
    from pipeline.replay import replay_command

    return reading_topics(replay_command, args)
