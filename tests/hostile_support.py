"""Shared by the hostile-input tests and the reliability probe: a read as another user (tests run
as root here, where a file's mode does not stop a read), a tree made readable to that user, and
a command line that must be refused in one line."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

OTHER_UID = 65534
"""The user a root process becomes to meet permission errors (nobody)."""


def as_other_user(fn: Callable[[], str]) -> str:
    """`fn()`'s text as a user who is not root: as root, in a forked child that gave up root for
    uid/gid `OTHER_UID` first (the child does file work only: a fork keeps no other thread);
    otherwise here. An exception that escapes `fn` comes back as "raw <class>: <message>"."""

    def attempt() -> str:
        try:
            return fn()
        except BaseException as e:  # noqa: BLE001 - handed back as text
            return f"raw {type(e).__name__}: {e}"

    if os.geteuid() != 0:
        return attempt()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            os.write(w, attempt().encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return text


def readable_tree(root: Path) -> None:
    """Every folder under `root` (and `root`) 0755, every file 0644 (checkpoints are private), so
    only the mode a test then sets stops the other user's read."""
    os.chmod(root, 0o755)
    for dirpath, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(dirpath, name), 0o755)
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o644)


def refused(capsys: Any, argv: list[str]) -> str:
    """The stderr of `tiered ARGV`, which must exit 2 with no traceback."""
    from tiered.cli.main import main

    assert main(argv) == 2
    err: str = capsys.readouterr().err
    assert "Traceback" not in err
    return err
