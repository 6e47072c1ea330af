import os
import shutil
import sys
from pathlib import Path

import pytest
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tiny  # noqa: E402
import workflow  # noqa: E402

# The longest modules first (seconds in a 2-worker run), so both pytest-xdist workers end together:
# loadscope hands modules out in collection order only with --no-loadscope-reorder (pyproject.toml);
# its default reorder, by test count, started the embedded default near the end of the suite.
LONGEST_FIRST = ("e2e/test_embedded_default.py",  # 450
                 "e2e/test_faults.py",  # 415
                 "e2e/test_tiny_run.py",  # 290
                 "e2e/test_slurm.py",
                 "test_workflow.py",  # 210
                 "e2e/test_regenerate_rules.py",  # 200
                 "e2e/test_data_curve_chain.py",  # 185
                 "e2e/test_disk_budget.py",  # 175
                 "test_regenerate.py",  # 140
                 "e2e/test_disk_budget_ddp.py",  # 120
                 "test_settings.py", "test_train_ddp.py", "e2e/test_mla_run.py", "test_data_curve.py")


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


@pytest.fixture(scope="session")
def finished_tiny(tmp_path_factory, worker_id) -> workflow.FinishedRun:
    """One finished tiny run (workflow.finish_tiny_run) for the whole session, made by the first
    pytest-xdist worker that asks (the others wait for it): its modules each made the same run."""
    if worker_id == "master":  # no workers: nothing to share
        return workflow.finish_tiny_run(tmp_path_factory.mktemp("finished"))
    shared = tmp_path_factory.getbasetemp().parent / "finished"  # the session's, above each worker's own
    shared.mkdir(exist_ok=True)
    with FileLock(str(shared) + ".lock"):
        if (shared / "DONE").exists():
            return workflow.load_finished_run(shared)
        for left in shared.iterdir():  # a worker that failed to finish it: build it again, to fail again here
            shutil.rmtree(left) if left.is_dir() else left.unlink()
        return workflow.finish_tiny_run(shared)


@pytest.fixture
def chats(tmp_path) -> Path:
    return tiny.make_chats(tmp_path / "chats.jsonl")
