"""Files kvgen writes or checks, each in one way: content hashes, and writes that a reader never
sees half done (a temp file beside the target, then one atomic rename).

Everything kvgen publishes is readable by others (0644 files, 0755 libraries), set explicitly: a
shared cache or registry must not turn private because of the writer's umask or ``mkstemp``'s 0600.
Writers that read, merge and rewrite a shared file hold ``file_lock`` around all three.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

FILE_MODE = 0o644


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_json_atomic(path: Path, data: Any) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_if_different(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` only if its content differs; atomic (temp file + rename).

    Unchanged files keep their mtime, so nothing downstream that watches files rebuilds.
    """
    path = Path(path)
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def copy_if_different(src: Path, dest: Path, sha256: str, mode: int = 0o755) -> None:
    """Publish ``src`` as ``dest`` (``mode``: 755 for a library, 644 for a data or source file)
    unless ``dest`` already has that sha256: a temp file beside it, then one atomic rename, so a
    reader never sees half a library. An identical ``dest`` keeps its bytes but gets ``mode`` (an
    older build may have left it 0600)."""
    if dest.is_file() and file_sha256(dest) == sha256:
        if dest.stat().st_mode & 0o777 != mode:
            os.chmod(dest, mode)
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created, never removed: removing a lock file lets two
    holders lock two different files). Released by the kernel when the process dies, so a killed
    writer never leaves it held."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def require_writable(directory: Path) -> None:
    """Create ``directory`` and write (then remove) one file in it, so that a destination that
    cannot take what a long job makes fails with its ``OSError`` (path included) before the job."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".kvgen-writable-"):
        pass
