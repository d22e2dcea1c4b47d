"""Walking prepare's sources: folders and `**` globs that follow symbolic links and read each
directory once (by device and inode), so a link loop ends instead of hanging, and a record of
everything not read, by reason (`Skipped`), for prepare's summary line."""

from __future__ import annotations

import fnmatch
import glob
import os
from pathlib import Path


class Skipped:
    """What a walk of the sources did not read, by reason, with the first few paths of each:
    prepare's summary line reports it (input is never dropped without a word)."""

    def __init__(self) -> None:
        self.reasons: dict[str, list[str]] = {}
        self.read = 0  # files collected

    def add(self, reason: str, path) -> None:
        self.reasons.setdefault(reason, []).append(str(path))

    def describe(self) -> str:
        if not self.reasons:
            return "skipped nothing"
        parts = []
        for reason, paths in sorted(self.reasons.items(), key=lambda kv: -len(kv[1])):
            more = f", +{len(paths) - 1} more" if len(paths) > 1 else ""
            parts.append(f"{len(paths)} {reason} (e.g. {paths[0]}{more})")
        return "skipped " + "; ".join(parts)


def _dir_key(path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)  # follows a link: the directory it leads to
    except OSError:
        return None
    return st.st_dev, st.st_ino


def walk(root: Path, suffixes: tuple[str, ...], skip_dirs: frozenset[str] = frozenset(),
          skipped: Skipped | None = None) -> list[str]:
    """Relative posix paths of matching files under root, sorted as strings so order never depends
    on the filesystem. Symbolic links are followed, each directory read once (by device and inode):
    a link back to a folder already read (a loop) is reported as skipped, never walked again.
    Everything not taken is counted in `skipped` with its reason."""
    skipped = Skipped() if skipped is None else skipped
    found = []
    seen = {_dir_key(root)}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        rel_dir = Path(dirpath).relative_to(root)
        keep = []
        for d in sorted(dirnames, key=lambda d: (os.path.islink(os.path.join(dirpath, d)), d)):  # real dirs first
            # Hidden dirs (.git, .venv) and caches are never corpus text; skipping them avoids swallowing a virtualenv.
            if d.startswith(".") or d == "__pycache__" or d in skip_dirs:
                skipped.add("hidden, cache or excluded folder(s)", root / rel_dir / d)
                continue
            key = _dir_key(os.path.join(dirpath, d))
            if key is None:
                skipped.add("broken link(s) or unreadable folder(s)", root / rel_dir / d)
            elif key in seen:
                skipped.add("link(s) to a folder already read (a loop, or a second way in)", root / rel_dir / d)
            else:
                seen.add(key)
                keep.append(d)
        dirnames[:] = keep
        for f in filenames:
            path = os.path.join(dirpath, f)
            if f.startswith("."):
                skipped.add("hidden file(s)", path)
            elif not os.path.exists(path):  # os.walk lists a broken link (to a file or a folder) here
                skipped.add("broken link(s) or unreadable folder(s)", path)
            elif not f.endswith(suffixes):
                skipped.add(f"file(s) not {'/'.join(suffixes)}", path)
            elif not os.path.isfile(path):
                skipped.add("not a regular file", path)
            else:
                found.append((rel_dir / f).as_posix())
    return sorted(found)


def expand(pattern: str, skipped: Skipped) -> list[str]:
    """glob.glob(pattern, recursive=True), but a `**` follows each directory once (by device and
    inode): Python's own follows links without end, so a link loop under `**` hung prepare."""
    if "**" not in pattern:
        return sorted(glob.glob(pattern))  # no recursion: finite whatever the links
    parts = pattern.split("/")
    first = next(i for i, p in enumerate(parts) if glob.has_magic(p))
    base = "/".join(parts[:first]) or ("/" if pattern.startswith("/") else ".")
    out: list[str] = []
    seen: set = set()

    def visible(name: str, part: str) -> bool:  # as glob: * and ** do not match hidden names
        return part.startswith(".") or not name.startswith(".")

    def match(d: str, rest: list[str]) -> None:
        if not rest:
            out.append(d)
            return
        part, tail = rest[0], rest[1:]
        if part == "**":
            key = (_dir_key(d), len(rest))
            if key[0] is None:
                skipped.add("broken link(s) or unreadable folder(s)", d)
                return
            if key in seen:
                skipped.add("link(s) to a folder already read (a loop, or a second way in)", d)
                return
            seen.add(key)
            match(d, tail)  # no folder at all
            try:
                names = sorted(os.listdir(d))
            except OSError:
                skipped.add("unreadable folder(s)", d)
                return
            for name in names:
                p = os.path.join(d, name)
                if not visible(name, ""):
                    continue
                if os.path.isdir(p):
                    match(p, rest)
                elif not tail:
                    out.append(p)
        elif glob.has_magic(part):
            try:
                names = sorted(os.listdir(d))
            except OSError:
                return
            for name in names:
                if fnmatch.fnmatch(name, part) and visible(name, part):
                    p = os.path.join(d, name)
                    if not tail or os.path.isdir(p):
                        match(p, tail)
        elif part == "":
            match(d, tail)  # "a//b", or the "/" after a trailing "**"
        elif os.path.lexists(os.path.join(d, part)):
            match(os.path.join(d, part), tail)

    if os.path.isdir(base):
        match(base, parts[first:])
    return sorted(dict.fromkeys(out))
