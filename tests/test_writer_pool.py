"""The shard writers' pool: processes that die with a killed parent, the kinds it knows."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglepipe.writer_pool import make_pool
from workflow import alive, children

REPO = Path(__file__).resolve().parents[1]
PARENT = """
import sys
from eaglepipe.writer_pool import make_pool
pool = make_pool("processes", 2, ("json",))
for f in [pool.submit(sum, [i]) for i in range(4)]:
    f.result()
print("ready", flush=True)
sys.stdin.read()  # idle writers wait for jobs, as during a long backend step
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_writer_processes_die_with_a_killed_parent():
    env = dict(os.environ, PYTHONPATH=str(REPO / "scripts"))
    p = subprocess.Popen([sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=env)
    try:
        assert p.stdout.readline() == "ready\n"
        writers = children(p.pid)
        # two writers (and multiprocessing's resource tracker, which leaves on its own)
        assert len(writers) >= 2 and all(map(alive, writers))
        p.send_signal(signal.SIGKILL)
        p.wait()
        deadline = time.time() + 30
        while any(map(alive, writers)) and time.time() < deadline:
            time.sleep(0.05)
        assert not any(map(alive, writers)), f"processes {writers} outlived their killed parent"
    finally:
        p.kill()


@pytest.mark.parametrize("kind", ["threads", "processes"])
def test_pools_run_jobs(kind):
    with make_pool(kind, 2) as pool:
        assert list(pool.map(sum, [[1, 2], [3]])) == [3, 3]


def test_unknown_pool_is_refused():
    with pytest.raises(ValueError, match="writer pool 'fibers'"):
        make_pool("fibers", 2)
