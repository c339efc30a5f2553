"""Reading the small files a user names (a config, a model's config.json, a bench JSON): regular
files only, bounded in size and nesting, every refusal naming the flag and the path.

[Note: files a user names]
A path on the command line (``--config``, ``--model``'s config.json, ``--bandwidth``, ``--data``)
may name anything: a FIFO (a plain open blocks until a writer comes: the command hangs), a device
(``/dev/zero`` never ends: reading it exhausts memory), a folder, a file of gigabytes where a
config of kilobytes belongs, or JSON nested deeper than Python's parser can recurse. So such a
file is opened ``O_NONBLOCK`` (a FIFO or device opens at once), checked with ``fstat`` to be a
regular file (symlinks are followed: a Hugging Face cache links its files to blobs) and, for the
small ones, to be at most a stated size before a byte is read; JSON nested too deeply is an
error, not a RecursionError. A file this user may not read is named with the user. Each refusal
is a ConfigError naming the flag the user wrote and the path, so the command prints one line.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from typing import Any

from tiered.errors import ConfigError

_KINDS = {
    stat.S_IFLNK: "a symlink",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
    stat.S_IFREG: "a regular file",
}
MAX_JSON_DEPTH = 64
"""Nesting a config file may have: configs are a few levels deep; a deeper one is refused before
any reader recurses into it."""


def kind_of(mode: int) -> str:
    """What an ``st_mode`` is, in words ("a FIFO")."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def this_user() -> str:
    """The effective user, as a permission error names it: ``'alice' (uid 1000)``."""
    uid = os.geteuid()
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name!r} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def unreadable(path: str | os.PathLike[str], what: str = "") -> str:
    """The words for `path` this user may not read: who, and what to do."""
    return (
        f"{what + ' ' if what else ''}{os.fspath(path)}: permission denied for user {this_user()}; "
        "make it readable by this user (chmod/chown) or run as a user who can read it"
    )


def open_regular_file(path: str | os.PathLike[str], what: str, *, hint: str = "") -> tuple[int, int]:
    """(fd, size) of the regular file `path`, which the user passed as `what` (a flag such as
    "--config"): anything else is a ConfigError saying what is there ([Note: files a user names]).
    `hint`: what to pass instead, appended to a refusal."""
    name = os.fspath(path)
    tail = f"; {hint}" if hint else ""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{what} {name}: no such file{tail}") from None
    except PermissionError:
        raise ConfigError(unreadable(name, what)) from None
    except OSError as exc:
        raise ConfigError(f"{what} {name}: cannot be opened ({exc.strerror or exc}){tail}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConfigError(f"{what} {name}: is {kind_of(st.st_mode)}, not a regular file{tail}")
    return fd, st.st_size


def read_user_file(path: str | os.PathLike[str], what: str, limit_bytes: int, *, hint: str = "") -> bytes:
    """The bytes of regular file `path` (see `open_regular_file`), refused when it holds more
    than `limit_bytes` (checked before reading, and again while reading: it may grow)."""
    name = os.fspath(path)
    fd, size = open_regular_file(name, what, hint=hint)
    try:
        if size > limit_bytes:
            raise ConfigError(_too_big(name, what, size, limit_bytes))
        chunks, got = [], 0
        while True:
            try:
                chunk = os.read(fd, min(1 << 20, limit_bytes + 1 - got))
            except PermissionError:  # e.g. a read the security module refuses
                raise ConfigError(unreadable(name, what)) from None
            except OSError as exc:
                raise ConfigError(f"{what} {name}: cannot be read ({exc.strerror or exc})") from None
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
            if got > limit_bytes:
                raise ConfigError(_too_big(name, what, got, limit_bytes))
    finally:
        os.close(fd)
    return b"".join(chunks)


def _too_big(name: str, what: str, size: int, limit_bytes: int) -> str:
    return (
        f"{what} {name}: {size:,} bytes or more, above the {limit_bytes:,} a file of this kind holds; "
        "is it the right file?"
    )


def parse_json_text(
    text: str | bytes,
    where: str,
    *,
    max_depth: int = MAX_JSON_DEPTH,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
    not_json: str = "not valid JSON",
) -> Any:
    """JSON `text` read from `where` (named in every error), at most `max_depth` levels of
    objects and lists deep; a syntax error says `not_json` and names the line and column."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{where}: not UTF-8 text (byte {exc.start}); is it a JSON file?") from None
    try:
        data = json.loads(text, object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise ConfigError(
            f"{where}: nests objects or lists deeper than Python's JSON parser can read; a file of this "
            f"kind is a few levels deep (at most {max_depth}): fix the file"
        ) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{where}: {not_json}: {exc.msg} at line {exc.lineno}, column {exc.colno}"
        ) from None
    check_depth(data, where, max_depth)
    return data


def check_depth(data: Any, where: str, max_depth: int = MAX_JSON_DEPTH) -> None:
    """ConfigError naming the first path of `data` nested deeper than `max_depth` (walked without
    recursion, so that a hostile document meets this error, not a RecursionError in a later
    reader)."""
    stack: list[tuple[str, Any, int]] = [("", data, 0)]
    while stack:
        path, node, depth = stack.pop()
        if depth > max_depth:
            raise ConfigError(
                f"{where}: {path[:120]!r}... nests deeper than {max_depth} levels; a file of this kind is a "
                "few levels deep: fix the structure"
            )
        children = (
            node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        )
        for k, v in children:
            if isinstance(v, dict | list):
                stack.append((f"{path}.{k}" if path else str(k), v, depth + 1))


def read_user_json(
    path: str | os.PathLike[str],
    what: str,
    limit_bytes: int,
    *,
    hint: str = "",
    max_depth: int = MAX_JSON_DEPTH,
    not_json: str = "not valid JSON",
) -> Any:
    """The JSON document in regular file `path`, bounded in size and depth ([Note: files a user
    names]); every error names `what` and the path."""
    data = read_user_file(path, what, limit_bytes, hint=hint)
    return parse_json_text(data, f"{what} {os.fspath(path)}", max_depth=max_depth, not_json=not_json)
