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


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return tiny.make_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_dsv3(tmp_path_factory) -> Path:
    return tiny.make_deepseek_v3(tmp_path_factory.mktemp("tiny_dsv3"))


@pytest.fixture
def chats(tmp_path) -> Path:
    return tiny.make_chats(tmp_path / "chats.jsonl")
