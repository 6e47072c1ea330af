"""The shard writers' pool: processes that die with a killed parent, the kinds it knows."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eaglepipe.writer_pool import make_pool

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


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    """Running, not a zombie left for a reaper (a container's init may never reap)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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
