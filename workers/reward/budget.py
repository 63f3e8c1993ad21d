"""The reward worker's failure budget, and its failures counted by kind and logged once per distinct error.

A failure reward is right for the odd completion a reward function cannot judge, but a function
that fails on most calls (a bug, a missing package, a field the rows lack) would train the model
on failure rewards alone and end "finished". So when more than `reward.max_failure_rate` of the
last `reward.failure_window` calls failed, the reward worker stops with `EXIT_CODE` and the
launcher ends the run with the verdict's one line. A traceback is logged the first time its
error is seen (its first line), then only counted: a failing function must not flood the log.
"""

from __future__ import annotations

from collections import Counter, deque

EXIT_CODE = 3  # the reward worker's exit status when its failure budget is spent: the run stops, no restart
MAX_LOGGED = 20  # distinct errors logged with their traceback; beyond that, errors are only counted


class RewardFailures:
    """The reward function's calls: failures by kind, the last `window` outcomes, the errors already logged."""

    def __init__(self, max_rate: float, window: int):
        self.max_rate, self.window = max_rate, window
        self.recent: deque[bool] = deque(maxlen=window)  # True: that call failed
        self.by_kind: Counter[str] = Counter()  # the exception's type, 'invalid', 'timeout', 'died'
        self.calls = 0
        self.logged: list[str] = []  # first lines of the errors logged, oldest first

    def record(self, details: dict[str, str] | None) -> bool:
        """One call: None when it gave a reward, else its failure details ('error', 'failure'). True when its
        error is new and its traceback should be logged (once per distinct first line, MAX_LOGGED at most)."""
        self.calls += 1
        self.recent.append(details is not None)
        if details is None:
            return False
        self.by_kind[details.get("failure", "error")] += 1
        first_line = details["error"].split("\n", 1)[0][:200]
        if first_line in self.logged or len(self.logged) >= MAX_LOGGED:
            return False
        self.logged.append(first_line)
        return True

    @property
    def exceeded(self) -> bool:
        """More than max_rate of a full window of calls failed."""
        return len(self.recent) == self.window and sum(self.recent) > self.max_rate * self.window

    def verdict(self) -> str:
        """Why the worker stops, with the counts and the fix, in one line."""
        kinds = ", ".join(f"{kind} {count}" for kind, count in self.by_kind.most_common())
        first = f"; first error: {self.logged[0]}" if self.logged else ""
        return (
            f"the reward function failed on {sum(self.recent)} of the last {self.window} calls, more than "
            f"reward.max_failure_rate={self.max_rate:g} ({kinds}{first}): fix data.reward, or raise "
            "reward.max_failure_rate to go on with failure rewards"
        )
