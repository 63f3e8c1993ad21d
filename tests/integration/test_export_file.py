"""The export file appended to by two processes: the chunk another process appended is read before the next append."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.unit.topics.test_export import HEADER, places, record, reward_group, write_two_chunks
from topics.export import ExportAppender, load_export


def test_a_chunk_another_process_appended_is_read_before_the_next_append(tmp_path: Path) -> None:
    """The launcher appends when the run stops: a process that appended before must see that chunk."""
    two_chunks = write_two_chunks(tmp_path / "topics.export")
    other = (
        "import sys; from pathlib import Path; sys.path[:0] = [sys.argv[2]];"
        "from tests.unit.topics.test_export import HEADER, record, reward_group; from topics.export import ExportAppender\n"
        "with ExportAppender(Path(sys.argv[1])) as appender:\n"
        "    appender.append(HEADER, [record('scored', 1, 2)], [reward_group(6)])\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", other, str(two_chunks), str(root)], check=True)
    with ExportAppender(two_chunks) as appender:
        assert appender.next_offsets() == {"batches": {0: 1}, "scored": {0: 3, 1: 3}}
        appender.append(HEADER, [record("scored", 0, 3)], [reward_group(7)])
    assert places(load_export(two_chunks).records["scored"]) == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2)]
