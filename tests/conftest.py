import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tiny  # noqa: E402

# The longest modules first: pytest-xdist's loadscope hands modules to the workers in collection
# order, and pytest collects a directory's files before its subdirectories, so the embedded default
# (tests/e2e/, about half of one worker's time) started last and left the other worker idle.
LONGEST_FIRST = ("e2e/test_embedded_default.py", "e2e/test_faults.py", "e2e/test_slurm.py",
                 "e2e/test_disk_budget.py")


def pytest_collection_modifyitems(config, items):
    def rank(item):
        path = item.nodeid.split("::")[0]
        return next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith(name)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return tiny.make_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_dsv3(tmp_path_factory) -> Path:
    return tiny.make_deepseek_v3(tmp_path_factory.mktemp("tiny_dsv3"))


@pytest.fixture
def chats(tmp_path) -> Path:
    return tiny.make_chats(tmp_path / "chats.jsonl")
