"""Where te_lab keeps what it builds or measures for one machine."""

from __future__ import annotations

import os
from pathlib import Path


def cache_directory() -> Path:
    """``$XDG_CACHE_HOME/te_lab``, by default ``~/.cache/te_lab``."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "te_lab"
