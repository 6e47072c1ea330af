"""One job per output directory: a second job on a held directory stops, the lock of a dead process
is taken over; a model directory without config.json is one sentence."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest

from eaglepipe.dir_lock import dir_lock
from workflow import REPO

HOLD = "import sys, time; from eaglepipe.dir_lock import dir_lock\nwith dir_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(600)"


def test_two_jobs_never_write_one_directory(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO / "scripts"))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit, match=f"{tmp_path} is being written by another job \\(process {holder.pid} "):
            with dir_lock(tmp_path):
                pass
    finally:
        holder.kill()  # kill -9: the lock file stays, naming a process that has ended
        holder.wait()


def test_the_lock_of_a_dead_process_is_taken_over_with_a_log_line(tmp_path, caplog):
    env = dict(os.environ, PYTHONPATH=str(REPO / "scripts"))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    with caplog.at_level(logging.WARNING), dir_lock(tmp_path):
        pass
    assert f"taking over the lock of process {holder.pid}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING), dir_lock(tmp_path):  # released cleanly last time
        pass
    assert "taking over" not in caplog.text


def test_a_second_training_job_on_a_running_ones_directory_stops(tmp_path):
    """The stage CLIs take the lock: the second job stops before touching the checkpoints."""
    from eaglepipe import train_draft

    env = dict(os.environ, PYTHONPATH=str(REPO / "scripts"))
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SystemExit, match="is being written by another job"):
            train_draft.main(["--manifest", "m", "--vocab", "v", "--model", "x", "--out-dir", str(tmp_path)])
    finally:
        holder.kill()
        holder.wait()


def test_a_model_directory_without_config_json_is_one_sentence(tmp_path, tiny_llama):
    from eaglepipe import extract_hidden_states, prepare_data, train_draft

    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    (model / "config.json").unlink()
    sentence = f"--model {model}: the model directory has no config.json"
    for main, argv in ((prepare_data.main, ["--data", "d", "--out-dir", str(tmp_path / "data")]),
                       (extract_hidden_states.main, ["--train", "t", "--eval", "e", "--shard-dir", str(tmp_path / "s"),
                                                     "--out", str(tmp_path / "p.json")]),
                       (train_draft.main, ["--manifest", "m", "--vocab", "v", "--out-dir", str(tmp_path / "t")])):
        with pytest.raises(SystemExit, match=sentence):
            main(["--model", str(model), *argv])
