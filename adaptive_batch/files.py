"""Every file a run writes appears under its final name complete, or not at all; and one run
at a time writes an output directory.

:func:`atomic_write` writes to a temporary name in the same directory, flushes it to disk and
renames it (a rename within a directory is atomic on POSIX), then makes the rename durable. A
crash leaves the old file or the new one, never a mixture; a failed write (a full disk)
removes its temporary and raises :class:`~adaptive_batch.errors.CheckpointWriteError`.

:class:`OutputDirLock` holds an OS file lock (``fcntl.flock``) on the output directory for the
run's lifetime. The kernel drops it when the process ends however it ends, so a killed run
leaves nothing to clean up.
"""

import fcntl
import hashlib
import os
import socket
import tempfile
from typing import IO, Any, Callable, Iterator, Optional

from adaptive_batch.errors import CheckpointWriteError, ConfigError, is_disk_full
from adaptive_batch.faults import fault_point
import adaptive_batch.logs as logs

LOCK_FILENAME = ".adaptive_batch.lock"
_WRITING = ".writing_"  # in every temporary's name: .<final name>.writing_<random>


def atomic_write(path: str, write: Callable[[IO[Any]], None], *, text: bool = False, fault: str = "file_written") -> str:
    """Writes ``path`` through ``write(file)``, complete or not at all; returns ``path``.

    Args:
        path: the final name.
        write: writes the content to the open temporary file.
        text: open it in text mode (binary otherwise).
        fault: the fault point between the flushed temporary and the rename.

    Raises:
        CheckpointWriteError: when the file system refuses the write (out of space, read-only,
            a permission); the temporary is removed and nothing replaces ``path``.
    """
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}{_WRITING}", dir=directory)
    except OSError as e:
        raise CheckpointWriteError.from_error(path, e) from e
    try:
        with os.fdopen(fd, "w" if text else "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        fault_point(fault)
        os.replace(temporary, path)
    except BaseException as e:
        cause = write_failure_cause(directory, e)  # while the temporary still takes its space
        _remove(temporary)
        if isinstance(cause, OSError) or is_disk_full(cause):
            raise CheckpointWriteError.from_error(path, cause) from e
        raise
    fsync_directory(directory)
    return path


def write_failure_cause(directory: str, error: BaseException) -> BaseException:
    """What made a write in ``directory`` fail with ``error``: the file system's own refusal of a
    small write there (out of space, over quota) when a library's writer said it in its own
    words (torch's "unexpected pos 704 vs 598"), else ``error``. Call it before removing what
    the failed write left, which frees the space it took."""
    if not isinstance(error, RuntimeError) or is_disk_full(error):
        return error
    try:
        fd, probe = tempfile.mkstemp(prefix=f".space_probe{_WRITING}", dir=directory)
    except OSError as refusal:
        return refusal
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(1 << 16))
            f.flush()
            os.fsync(f.fileno())
    except OSError as refusal:
        return refusal
    finally:
        _remove(probe)
    return error


# At most this many bytes are read for a digest: files whole while it lasts, then 16 samples of
# 64 KiB a file, then names and sizes alone; a resume over a large dataset costs seconds.
_DIGEST_READ_BYTES = 1 << 30
_DIGEST_SAMPLES, _DIGEST_SAMPLE_BYTES = 16, 1 << 16


def content_digest(path: str) -> str:
    """What ``path`` (a file, or a directory's files) holds, wherever it lives: a SHA-256 of the
    files' names relative to ``path``, sizes and contents (sampled past a read budget), and the
    total size."""
    files = [""] if os.path.isfile(path) else sorted(f for f in walk_files(path) if _WRITING not in f)
    digest, total, read_left = hashlib.sha256(), 0, _DIGEST_READ_BYTES
    for name in files:
        full = os.path.join(path, name) if name else path
        size = os.path.getsize(full)
        total += size
        digest.update(f"{name}\0{size}\0".encode())
        sampled = _DIGEST_SAMPLES * _DIGEST_SAMPLE_BYTES
        if read_left < min(size, sampled):
            continue
        with open(full, "rb") as f:
            if size <= read_left:
                read_left -= size
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
                continue
            read_left -= sampled
            for i in range(_DIGEST_SAMPLES):
                f.seek(size * i // _DIGEST_SAMPLES)
                digest.update(f.read(_DIGEST_SAMPLE_BYTES))
    return f"sha256:{digest.hexdigest()[:20]} ({total} bytes)"


def fsync_directory(directory: str) -> None:
    """Makes the renames in ``directory`` durable."""
    _fsync(directory)


def fsync_tree(root: str) -> None:
    """Flushes every file and directory under ``root`` to disk (files another library wrote)."""
    for directory, _, names in os.walk(root):
        for name in names:
            _fsync(os.path.join(directory, name))
        _fsync(directory)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_partial_writes(directory: str, log: Optional[Callable[[str], None]] = None) -> None:
    """Deletes the temporaries of :func:`atomic_write` a crash left anywhere under ``directory``
    (never a finished file); only for a directory this run holds (:class:`OutputDirLock`). Each
    removal is said to ``log`` (``None``: the ``adaptive_batch`` logger)."""
    if not os.path.isdir(directory):
        return
    with logs.lines_to(log):
        for relative in list(walk_files(directory)):
            folder, name = os.path.split(relative)
            if name.startswith(".") and _WRITING in name:
                os.unlink(os.path.join(directory, relative))
                where = os.path.join(directory, folder) if folder else directory
                logs.info(f"Removed {name[1:name.index(_WRITING)]}, left half-written in {where} by an interrupted run.")


def walk_files(root: str) -> Iterator[str]:
    """Every file under ``root``, as a path relative to it, in a fixed order."""
    for directory, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            yield os.path.relpath(os.path.join(directory, name), root)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class OutputDirLock:
    """An exclusive lock on ``output_dir`` for as long as this object holds it.

    Args:
        output_dir: the run's output directory (created if missing).

    Raises:
        ConfigError: from :meth:`acquire`, when a live process holds it, naming that process.
    """

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_FILENAME)
        self._file: Optional[IO[str]] = None

    def acquire(self) -> "OutputDirLock":
        """Takes the lock and records this process in the lock file; returns ``self``.

        Raises:
            ConfigError: when another live process holds it.
        """
        os.makedirs(self.output_dir, exist_ok=True)
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise ConfigError(
                f"output_dir={self.output_dir} is in use by a live run ({holder}): wait for it to end, or give this "
                "run another output_dir."
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        self._file = f
        return self

    def release(self) -> None:
        """Drops the lock (closing the file drops it); a second call does nothing."""
        if self._file is not None:
            self._file.close()
            self._file = None
