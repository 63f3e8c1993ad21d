"""Shared fixtures: one real broker for the whole session, and fresh topics per test.

Tests share the broker (it starts in ~0.1 s, but a group join costs seconds,
so tests isolate themselves by topic name and group id, not by broker).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator

import pytest

from topics.admin import ensure_topics
from topics.broker import EmbeddedBroker
from topics.names import TopicLayout


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker(tmp_path_factory.mktemp("broker") / "broker.log") as running:
        yield running


@pytest.fixture
def unique_name(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """Makes names (topics, groups) no other test uses: `unique_name("scored")`."""
    test = re.sub(r"[^A-Za-z0-9._-]+", "-", request.node.name)[:100]

    def make(label: str = "t") -> str:
        return f"{test}.{label}.{uuid.uuid4().hex[:8]}"

    return make


@pytest.fixture
async def topic_layout(broker: EmbeddedBroker, unique_name: Callable[[str], str]) -> TopicLayout:
    """The six run topics, created on the session broker under a prefix of this test's own."""
    layout = TopicLayout(prefix=unique_name("run") + ".")
    await ensure_topics(broker.bootstrap, layout.names, layout.partitions)
    return layout
