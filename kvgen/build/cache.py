"""Content-addressed build cache: one directory per (kvgen version, arch, family, key).

Lifecycle (FlashInfer's ``build_and_load``, QuACK's crash-safe cache):
1. fast path: a published entry whose ``meta.json`` matches the key and whose artifact matches
   its recorded sha256 is a hit, no lock taken;
2. otherwise take the per-key ``flock`` and look again (another process may have just published);
3. build into ``tempfile.mkdtemp`` beside the entry, ``os.replace`` it into place, then write
   ``meta.json`` LAST: it is the commit marker. A directory without it is never loaded; a build
   killed at any point leaves only a temp directory or an unmarked one, both removed and rebuilt
   by the next lock holder (flock dies with its process, so nothing waits on a dead builder).
Lock files are kept: deleting one while another process waits on it would split the lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from kvgen.files import file_sha256, write_json_atomic

# Bump when the entry layout or meta.json fields change: old entries then miss instead of misload.
CACHE_SCHEMA_VERSION = 1
META = "meta.json"

BuildFn = Callable[[Path], dict[str, Any]]


def entry_dir(cache_dir: Path, kvgen_version: str, arch: str, family: str, key: str) -> Path:
    return Path(cache_dir) / kvgen_version / arch / f"{family}-{key[:16]}"


def failed_dir(entry: Path) -> Path:
    """Where the sources and log of the last failed build of an entry are kept for inspection."""
    return entry.with_name(entry.name + ".failed")


def load_entry(entry: Path, key: str) -> dict[str, Any] | None:
    """The metadata of a committed, intact entry for ``key``; None for anything less."""
    try:
        meta = json.loads((entry / META).read_text(encoding="utf-8"))
        artifact = entry / meta["artifact"]
        if meta.get("key") != key or meta.get("schema") != CACHE_SCHEMA_VERSION:
            return None
        if file_sha256(artifact) != meta["artifact_sha256"]:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta


@contextmanager
def entry_lock(entry: Path) -> Iterator[None]:
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.with_name(entry.name + ".lock"), "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _discard(path: Path) -> None:
    """Rename aside first so a lock-free reader never sees a half-deleted directory."""
    if not path.exists():
        return
    trash = Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{path.name}.trash-"))
    os.replace(path, trash / "x")
    shutil.rmtree(trash, ignore_errors=True)


def _clean_leftovers(entry: Path) -> None:
    """Under the lock: temp dirs of this key belong to dead builders; an unmarked entry is junk."""
    for pattern in (f"{entry.name}.tmp-*", f"{entry.name}.trash-*"):
        for leftover in entry.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)
    _discard(entry)


def _keep_failed(tmp: Path, entry: Path) -> None:
    failed = failed_dir(entry)
    _discard(failed)
    os.replace(tmp, failed)


def get_or_build(entry: Path, key: str, build: BuildFn) -> tuple[dict[str, Any], bool]:
    """Metadata of the entry for ``key`` and whether it was a hit; builds it if needed.

    ``build(tmp)`` writes into ``tmp`` and returns metadata naming its ``artifact`` (relative to
    the entry). A failing build keeps its directory as ``failed_dir(entry)`` and re-raises.
    """
    meta = load_entry(entry, key)
    if meta is not None:
        return meta, True
    with entry_lock(entry):
        meta = load_entry(entry, key)
        if meta is not None:
            return meta, True
        _clean_leftovers(entry)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f"{entry.name}.tmp-"))
        os.chmod(tmp, 0o755)   # mkdtemp's 0700 would make a shared cache unreadable to others
        try:
            meta = dict(build(tmp))
            meta.update(key=key, schema=CACHE_SCHEMA_VERSION,
                        artifact_sha256=file_sha256(tmp / meta["artifact"]))
        except Exception:
            _keep_failed(tmp, entry)
            raise
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        os.replace(tmp, entry)
        write_json_atomic(entry / META, meta)
        return meta, False


_VERSION_DIR = re.compile(r"^\d+\.\d+")


def clear_cache(cache_dir: Path) -> list[Path]:
    """Remove every kvgen version directory under ``cache_dir`` (and nothing else: a mistaken
    ``--cache-dir $HOME`` must not delete a home directory)."""
    removed = []
    cache_dir = Path(cache_dir)
    if not cache_dir.is_dir():
        return removed
    for child in sorted(cache_dir.iterdir()):
        if child.is_dir() and _VERSION_DIR.match(child.name):
            shutil.rmtree(child)
            removed.append(child)
    return removed
