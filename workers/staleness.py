"""The staleness bound shared by the prompt source (release) and the trainer (admission)."""

from __future__ import annotations


def may_release(
    released: int, version: int, batch_groups: int, max_staleness: int, dropped: int, max_in_flight: int = 0
) -> bool:
    """True while another group may be released: N < (i + eta + 1) * B + dropped, and, with a cap,
    N < i * B + max_in_flight + dropped (at most that many released and not yet trained or dropped).

    released: groups released so far (N); version: latest trainer version (i);
    dropped: groups the trainer discarded, which free their slots again. The cap keeps eta a deadline for
    stragglers rather than a standing lag: groups released beyond what the rollout workers decode at once
    wait in a queue, and spend their eta versions there.
    """
    bound = (version + max_staleness + 1) * batch_groups
    if max_in_flight:
        bound = min(bound, version * batch_groups + max_in_flight)
    return released < bound + dropped


def staleness(trainer_version: int, released_at_version: int) -> int:
    """How many versions behind the trainer a group is when it would be trained."""
    return trainer_version - released_at_version


def admissible(trainer_version: int, released_at_version: int, max_staleness: int) -> bool:
    """A group trains at version v only if it was released at v - eta or later."""
    return staleness(trainer_version, released_at_version) <= max_staleness
