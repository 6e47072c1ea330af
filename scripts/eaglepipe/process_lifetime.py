"""A child process that must not outlive its parent: a shard writer, the disk budget's extractor, a
training rank under torchrun. Killed with -9, a parent runs no cleanup, so the child is told by the
kernel instead (Linux PR_SET_PDEATHSIG; elsewhere the callers' own parent checks stop it)."""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int | None = None) -> None:
    """SIGKILL this process when its parent dies, however it dies. The signal is bound to the parent's
    thread that started the child (the callers start theirs from the main thread). ``parent``: the pid
    expected, so that a parent that died before the signal was armed ends the child too. Safe as a
    ``preexec_fn`` (no import but ctypes)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        os._exit(1)
