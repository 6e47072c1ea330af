"""The check every stage makes of a target given as a local directory, before transformers reads it.

Without ``config.json`` transformers guesses at the tokenizer and fails far from the cause (a
sentencepiece error for a directory without the config).
"""

from __future__ import annotations

from pathlib import Path


def check_model_dir(model: str) -> None:
    """SystemExit naming the directory when a local target has no config.json; hub ids pass."""
    d = Path(model)
    if d.is_dir() and not (d / "config.json").is_file():
        raise SystemExit(f"--model {model}: the model directory has no config.json (an incomplete download or "
                         "the wrong directory? target.model must be the directory that holds config.json)")
