import os

import pytest

from eaglepipe.atomic import atomic_dir, atomic_path, remove_stale_temporaries


def test_atomic_dir_replaces_whole_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "old.bin").write_text("old")
    with atomic_dir(out) as tmp:
        (tmp / "new.bin").write_text("new")
        assert not (out / "new.bin").exists()  # invisible until the block ends
    assert sorted(p.name for p in out.iterdir()) == ["new.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "new.bin").stat().st_mode & 0o777 == 0o666 & ~umask


def test_atomic_dir_failure_keeps_the_old_directory(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "old.bin").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(out) as tmp:
            (tmp / "half.bin").write_text("half")
            raise RuntimeError("killed")
    assert sorted(p.name for p in out.iterdir()) == ["old.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_atomic_path_failure_writes_nothing(tmp_path):
    target = tmp_path / "x.json"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("partial")
            raise RuntimeError
    assert list(tmp_path.iterdir()) == []
    (tmp_path / ".tmp-x.json.abc").write_text("left by a kill -9")
    assert remove_stale_temporaries(tmp_path) == 1


def test_atomic_dir_removes_what_a_killed_write_of_the_same_path_left(tmp_path):
    out = tmp_path / "draft"
    killed_tmp, killed_old = tmp_path / ".tmp-draft.abc123", tmp_path / ".tmp-old-draft.def456"
    (killed_old / "draft").mkdir(parents=True)
    killed_tmp.mkdir()
    (killed_tmp / "model.safetensors").write_bytes(b"half")
    other = tmp_path / ".tmp-draft2.xyz"  # another path's write in flight is left alone
    other.mkdir()
    with atomic_dir(out) as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-draft2.xyz", "draft"]
