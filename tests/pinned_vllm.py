"""The pinned vLLM wheel whose source tests read (never import): .ci/run downloads it."""
from __future__ import annotations

import os
from pathlib import Path


def vllm_wheel() -> Path | None:
    """The pinned wheel (pip download --no-deps vllm==0.26.0 -d /tmp/vllmwheel), or $EAGLEPIPE_VLLM_WHEEL."""
    given = os.environ.get("EAGLEPIPE_VLLM_WHEEL")
    if given:
        return Path(given)
    found = sorted(Path("/tmp/vllmwheel").glob("vllm-0.26.0-*.whl"))
    return found[0] if found else None
