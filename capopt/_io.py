"""Reading the user's files: every way a read or a parse can fail becomes one `CapoptError`.

Scenario, card, GPU and profile files all pass through here, so a directory given as a file,
a name too long for the file system, bytes that are not UTF-8, a TOML or JSON document nested
thousands deep or an integer too long to convert each give one line naming the file, never a
traceback.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

from ._errors import CapoptError


def path_exists(p: str | os.PathLike) -> bool:
    """``Path(p).exists()`` that is False, not an exception, for a name the OS refuses
    (too long, a NUL byte)."""
    try:
        return Path(p).exists()
    except (OSError, ValueError):
        return False


def is_file(p: str | os.PathLike) -> bool:
    try:
        return Path(p).is_file()
    except (OSError, ValueError):
        return False


def read_text(path: str | os.PathLike, *, field: str | None = None) -> str:
    """The file's text (UTF-8), or a `CapoptError` naming it."""
    file = str(path)
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CapoptError("no such file", file=file, field=field) from None
    except IsADirectoryError:
        raise CapoptError("is a directory, not a file", file=file, field=field) from None
    except UnicodeDecodeError as e:
        raise CapoptError(f"not UTF-8 text (byte {e.start})", file=file, field=field) from None
    except (OSError, ValueError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise CapoptError(f"cannot read: {why}", file=file, field=field) from None


def parse_toml(text: str, file: str | None, *, what: str = "TOML") -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise CapoptError(f"malformed {what}: {e}", file=file) from None
    except RecursionError:
        raise CapoptError(f"malformed {what}: nested too deeply", file=file) from None


def parse_json(text: str, file: str | None) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise CapoptError(f"not valid JSON: {e}", file=file) from None
    except RecursionError:
        raise CapoptError("not valid JSON: nested too deeply", file=file) from None
    except ValueError as e:           # e.g. an integer beyond sys.get_int_max_str_digits()
        raise CapoptError(f"not valid JSON: {e}", file=file) from None


def nesting_depth(value: Any, limit: int = 64) -> int:
    """How deep lists and tables nest in ``value``, counting up to ``limit`` (iteratively,
    so a document nested thousands deep is measured, not recursed into)."""
    depth, frontier = 0, [value]
    while frontier and depth < limit:
        nxt = []
        for v in frontier:
            if isinstance(v, dict):
                nxt.extend(v.values())
            elif isinstance(v, (list, tuple)):
                nxt.extend(v)
        if not nxt:
            break
        depth += 1
        frontier = nxt
    return depth


def check_depth(value: Any, file: str | None, field: str | None = None, limit: int = 16):
    """A `CapoptError` when ``value`` nests deeper than any valid input does."""
    if nesting_depth(value, limit + 1) > limit:
        raise CapoptError(f"nested more than {limit} levels deep", file=file, field=field)



__all__ = ["check_depth", "is_file", "nesting_depth", "parse_json", "parse_toml",
           "path_exists", "read_text"]
