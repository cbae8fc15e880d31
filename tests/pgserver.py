"""A throwaway PostgreSQL server for tests, started on loopback by the test itself.

``postgres_server(base_dir)`` initialises a fresh cluster under ``base_dir``, serves it on
127.0.0.1 only, yields a SQLAlchemy URL for a new database and stops the server on exit.
A real server (not SQLite) is what lets several processes share one optuna study.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import stat
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg2  # the `tune` extra

SUPERUSER = "postgres"
DBNAME = "kvgen"
START_TIMEOUT_S = 30
_SERVER_BINARIES = ("initdb", "pg_ctl", "postgres")


def find_pg_bin() -> Path:
    """The directory holding initdb, pg_ctl and postgres: PATH first, then the newest
    /usr/lib/postgresql/<version>/bin (Debian keeps the server binaries off PATH), then the
    server the `pgserver` wheel bundles (scripts/bootstrap.sh installs it when neither exists)."""
    candidates = []
    on_path = shutil.which("pg_ctl")
    if on_path:
        # Resolve symlinks: pg_ctl looks for `postgres` next to its real location.
        candidates.append(Path(on_path).resolve().parent)
    versioned = Path("/usr/lib/postgresql").glob("*/bin")
    candidates += sorted(versioned, key=lambda d: _version_key(d.parent.name), reverse=True)
    bundled = importlib.util.find_spec("pgserver")   # a server from PyPI, where the system has none
    if bundled is not None and bundled.origin:
        candidates.append(Path(bundled.origin).parent / "pginstall" / "bin")
    for bin_dir in candidates:
        if all(os.access(bin_dir / name, os.X_OK) for name in _SERVER_BINARIES):
            return bin_dir
    raise RuntimeError(
        "PostgreSQL server binaries (initdb, pg_ctl, postgres) not found on PATH or in "
        "/usr/lib/postgresql/*/bin, and no `pgserver` wheel; install the server, e.g. "
        "`apt-get install postgresql` or `pip install pgserver`"
    )


def _version_key(name: str) -> tuple[int, ...]:
    # Numeric, so that 16 sorts above 9.6; non-numeric names sort last.
    return tuple(int(p) for p in name.split(".")) if name.replace(".", "").isdigit() else ()


def _free_port() -> int:
    # The kernel picks an unused port; another process could take it before the server
    # binds it, but then `pg_ctl start` fails loudly rather than talking to a stranger.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_server_user(base_dir: Path, owned: list[Path]) -> list[str]:
    """Command prefix that runs initdb/pg_ctl as a non-root user.

    initdb and postgres refuse to run as root, so as root we hand the directories the
    server writes to the `postgres` system user and run the binaries through runuser.
    """
    if os.geteuid() != 0:
        return []
    if shutil.which("runuser") is None:
        raise RuntimeError("running as root needs `runuser` (util-linux) to drop to `postgres`")
    try:
        shutil.chown(owned[0], user="postgres")
    except LookupError:
        raise RuntimeError(
            "running as root needs a `postgres` system user for the server "
            "(the postgresql package creates it)"
        ) from None
    for path in owned[1:]:
        shutil.chown(path, user="postgres")
    # Temp roots (pytest's /tmp/pytest-of-root) are 0700; the server must be able to walk
    # through them. Search permission only (o+x), no listing; pytest re-privatises its
    # root on its next run.
    for d in (base_dir, *base_dir.parents):
        mode = d.stat().st_mode
        if not mode & stat.S_IXOTH:
            d.chmod(mode | stat.S_IXOTH)
    return ["runuser", "-u", "postgres", "--"]


@contextmanager
def postgres_server(base_dir: Path) -> Iterator[str]:
    """Run a fresh PostgreSQL cluster in ``base_dir`` and yield its SQLAlchemy URL,
    ``postgresql+psycopg2://postgres@127.0.0.1:PORT/kvgen``; the server stops on exit.

    Creates ``base_dir/data`` (the cluster) and ``base_dir/run`` (unix socket, server
    log); nothing is deleted, so the log stays for post-mortems.
    """
    bin_dir = find_pg_bin()
    data_dir, run_dir = base_dir / "data", base_dir / "run"
    data_dir.mkdir(mode=0o700)  # initdb insists on a private data directory
    run_dir.mkdir()
    log_file = run_dir / "postgres.log"
    log_file.touch()
    prefix = _as_server_user(base_dir, [data_dir, run_dir, log_file])

    def run(*args: str, timeout: float) -> None:
        # cwd=run_dir: the caller's cwd may not be readable by the `postgres` user.
        proc = subprocess.run(
            [*prefix, *args], cwd=run_dir, capture_output=True, text=True, timeout=timeout
        )
        if proc.returncode != 0:
            log = log_file.read_text(errors="replace")[-4000:]
            raise RuntimeError(
                f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
                f"\n--- {log_file} ---\n{log}"
            )

    # --no-sync: a throwaway cluster needs no durability, and this saves seconds.
    run(
        str(bin_dir / "initdb"), "-D", str(data_dir), "-U", SUPERUSER,
        "--no-locale", "-E", "UTF8", "--auth=trust", "--no-sync",
        timeout=120,
    )
    # Settings go in the config file rather than `pg_ctl -o`, which passes through a shell.
    # listen_addresses: with trust auth, nothing beyond this host may connect.
    # unix_socket_directories: keep the socket out of the shared /var/run/postgresql.
    # fsync=off: same reason as --no-sync above.
    port = _free_port()  # picked late: the less time before the server binds it, the better
    quoted_run_dir = str(run_dir).replace("'", "''")
    with open(data_dir / "postgresql.conf", "a") as conf:
        conf.write(
            f"\nlisten_addresses = '127.0.0.1'\nport = {port}\n"
            f"unix_socket_directories = '{quoted_run_dir}'\nfsync = off\n"
        )
    try:
        # -w: pg_ctl returns only once the server accepts connections (or the timeout hits).
        run(
            str(bin_dir / "pg_ctl"), "start", "-w", "-t", str(START_TIMEOUT_S),
            "-D", str(data_dir), "-l", str(log_file),
            timeout=START_TIMEOUT_S + 10,
        )
        conn = psycopg2.connect(host="127.0.0.1", port=port, user=SUPERUSER, dbname="postgres")
        try:
            conn.autocommit = True  # CREATE DATABASE cannot run inside a transaction
            with conn.cursor() as cur:
                cur.execute(f"CREATE DATABASE {DBNAME}")
        finally:
            conn.close()
        yield f"postgresql+psycopg2://{SUPERUSER}@127.0.0.1:{port}/{DBNAME}"
    finally:
        # Also runs when start failed half-way; with no server running it is a no-op.
        # -m fast: disconnect clients (e.g. pooled SQLAlchemy connections) instead of
        # waiting for them.
        subprocess.run(
            [*prefix, str(bin_dir / "pg_ctl"), "stop", "-w", "-m", "fast", "-D", str(data_dir)],
            cwd=run_dir, capture_output=True, timeout=60,
        )
