"""The staleness bound shared by the prompt source (release) and the trainer (admission)."""

from __future__ import annotations

SKIP_WINDOW = 8  # versions over which the prompt source measures how many groups the trainer skips per version


def may_release(
    released: int,
    version: int,
    batch_groups: int,
    max_staleness: int,
    dropped: int,
    max_in_flight: int = 0,
    ahead: int = 0,
) -> bool:
    """True while another group may be released: N < (i + eta + 1) * B + ahead + dropped, and, with a cap,
    N < i * B + max_in_flight + dropped (at most that many released and not yet trained or dropped).

    released: groups released so far (N); version: latest trainer version (i); dropped: groups the trainer
    discarded, which free their slots again; ahead: the skips expected next (`skips_ahead`), released before
    they happen. The cap keeps eta a deadline for stragglers rather than a standing lag: groups released
    beyond what the rollout workers decode at once wait in a queue, and spend their eta versions there.
    """
    bound = (version + max_staleness + 1) * batch_groups + ahead
    if max_in_flight:
        bound = min(bound, version * batch_groups + max_in_flight)
    return released < bound + dropped


def skips_ahead(skipped_by: dict[int, int], version: int, max_staleness: int) -> int:
    """Groups to release ahead of the trainer's skips (groups without advantage): its skips per version since
    the oldest version noted within the last SKIP_WINDOW, rounded down; 0 at eta = 0 (synchronous: a group
    released beyond what version i trains would be dropped stale at i + 1).

    skipped_by: the trainer's skip count (`groups_skipped`) as each version was first announced. A skipped
    group's slot comes back only when its drop is announced, and the group released in its place reaches the
    trainer a round trip later (source, rollout, reward, trainer): a run that skips most groups starves between
    its steps. One version's skips released ahead covers that round trip. More would not pay: each version's
    releases then wait longer for the trainer, run past their deadline and are dropped stale.
    """
    past = [v for v in skipped_by if version - SKIP_WINDOW <= v < version]
    if not max_staleness or version not in skipped_by or not past:
        return 0
    first = min(past)
    return max(0, (skipped_by[version] - skipped_by[first]) // (version - first))  # < 0: a trainer restarted alone


def staleness(trainer_version: int, released_at_version: int) -> int:
    """How many versions behind the trainer a group is when it would be trained."""
    return trainer_version - released_at_version


def admissible(trainer_version: int, released_at_version: int, max_staleness: int) -> bool:
    """A group trains at version v only if it was released at v - eta or later."""
    return staleness(trainer_version, released_at_version) <= max_staleness
