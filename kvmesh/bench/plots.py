"""One way the benchmarks make and save their plots (matplotlib, headless, imported only when a plot is asked for),
and check, before a run, that the files they will write (--json, --plot) can be written."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend (no display here, nor on CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> None:
    """Lay out, write `path` (creating its folder) and free the figure."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def check_output_path(path: str | Path | None, flag: str) -> None:
    """Raise ValueError ("--json PATH: ...") when the file a benchmark will write at its end cannot be: `path` is a
    folder, or its nearest existing ancestor is a file or a folder this process cannot write. Called before the run,
    so that a bad path costs nothing; folders that do not exist yet are fine (the benchmark creates them). Nothing is
    created here. None (the flag not given) passes."""
    if path is None:
        return
    text = os.fspath(path)
    if not text:
        raise ValueError(f"{flag}: an empty path")
    target = Path(text)
    if target.is_dir() or text.endswith(("/", os.sep)):
        raise ValueError(f"{flag} {text}: is a folder; give a file name")
    if target.exists():
        if not os.access(target, os.W_OK):
            raise ValueError(f"{flag} {text}: cannot be written: permission denied")
        return
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:  # the nearest one that exists (a dangling link too)
        if ancestor.is_symlink():
            raise ValueError(f"{flag} {text}: cannot be written: {ancestor} is a broken link")
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{flag} {text}: cannot be written: {ancestor} is a file, not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {text}: cannot be written: folder {ancestor} is not writable")
