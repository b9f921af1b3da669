"""Run-directory locks: one process at a time works in a run directory.

A lock is an exclusive ``flock`` on the file ``.pdefit.lock`` in the directory, taken without
waiting: a second command on the same directory is refused at once, naming the process that
holds it. The operating system releases the lock when its holder exits, however it ends
(killed, crashed), so a lock is never stale. The file exists only while the lock is held (its
holder removes it before unlocking, and a taker checks that the file it locked is still the
one named ``.pdefit.lock``), so a refused or repeated command leaves the directory as it found
it; one left by a killed process is empty and harmless. The holder is found from the kernel's
table of locks (``/proc/locks``, Linux) where it is visible; a filesystem without locks gives
a warning and an unlocked run rather than no run.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
from pathlib import Path

from pdefit.options import ConfigError

log = logging.getLogger("pdefit")

LOCK_FILE = ".pdefit.lock"
KERNEL_LOCKS = Path("/proc/locks")


class DirectoryLock:
    """A held lock on a directory (or none: ``fd`` None), released by :meth:`release` or
    the end of a ``with`` block; releasing twice is harmless."""

    def __init__(self, directory: Path, fd: int | None) -> None:
        self.directory = directory
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):  # removed while held: no one else has it
                (self.directory / LOCK_FILE).unlink()
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def no_lock(directory: Path) -> DirectoryLock:
    """A lock that holds nothing (another process of a multi-process run holds the real one)."""
    return DirectoryLock(directory, None)


def lock_directory(directory: Path, key: str = "run.dir") -> DirectoryLock:
    """Lock ``directory`` (which exists) for this process, or raise a ConfigError naming
    ``key``, the directory and the holder when another process holds it."""
    path = directory / LOCK_FILE
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise ConfigError(f"{key}: cannot create the lock file {path} ({err.strerror})"
                              ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ConfigError(
                f"{key}: {directory} is in use by another pdefit process ({holder}); wait "
                f"for it to end, or choose another {key}") from None
        except OSError as err:  # a filesystem without locks (some network mounts)
            os.close(fd)
            log.warning(f"{key}: {directory} cannot be locked ({err.strerror}); running "
                        "without a lock: do not start a second run in this directory meanwhile")
            return no_lock(directory)
        if _same_file(fd, path):
            return DirectoryLock(directory, fd)
        os.close(fd)  # its holder removed the file between our open and lock: again


def _same_file(fd: int, path: Path) -> bool:
    try:
        named, held = path.stat(), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _holder(fd: int) -> str:
    """Who holds the lock on ``fd``'s file: ``pid N on host H`` when the kernel shows it."""
    stat = os.fstat(fd)
    try:
        lines = KERNEL_LOCKS.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 08:01:1234 0 EOF" (device numbers in hex)
        if len(fields) < 6 or fields[1] != "FLOCK":  # "->": a waiter
            continue
        try:
            major, minor, inode = fields[5].split(":")
            pid = int(fields[4])
            same = (int(major, 16), int(minor, 16), int(inode)) == (
                os.major(stat.st_dev), os.minor(stat.st_dev), stat.st_ino)
        except ValueError:
            continue
        if same and pid > 0:
            return f"pid {pid} on host {socket.gethostname()}"
    return "its process is not visible from here: another host?"
