"""The lock a training run holds on its save directory: two runs writing one directory's checkpoints at
once would each prune, resume and overwrite the other's (both end "successfully", one run's checkpoints
are lost).

The lock is the file ``<save dir>/.lock``, holding its owner as JSON (host, pid, run id, start time). It
is held with ``flock`` on an open descriptor, which the kernel releases when the owner exits however it
ends: the lock of a killed run is stale and the next run takes it over (and says whose it was). Where the
filesystem has no ``flock``, the recorded owner decides: a lock of this host whose pid is gone is stale
and taken over; one of another host, or of a live pid, is refused.

The file is never deleted (deleting a lock file another run has just opened would let a third one lock a
new file): releasing empties it.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket

from megamoe import comms
from megamoe.checkpoint.errors import CheckpointError

__all__ = ["LOCK_FILE", "SaveDirLock", "SaveDirBusyError", "lock_save_dir"]

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"


class SaveDirBusyError(CheckpointError):
    """Another live run holds the save directory's lock."""


def _pid_alive(pid) -> bool:
    """Whether the process ``pid`` (as recorded: anything) exists on this host."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True             # it exists, owned by someone else
    return True


def _read_owner(handle) -> dict | None:
    handle.seek(0)
    try:
        owner = json.loads(handle.read() or "null")
    except ValueError:
        return None
    return owner if isinstance(owner, dict) else None


def _describe(owner: dict | None) -> str:
    if owner is None:
        return "an unknown run"
    return (f"run {owner.get('run_id', '?')} (host {owner.get('host', '?')}, pid {owner.get('pid', '?')}, "
            f"since {owner.get('started', '?')})")


class SaveDirLock:
    """A held lock (see :func:`lock_save_dir`); :meth:`release` ends it (so does the process's exit)."""

    def __init__(self, path: str, handle):
        self.path, self._handle = path, handle

    def release(self) -> None:
        if self._handle is None:
            return
        try:
            self._handle.truncate(0)
            self._handle.flush()
        finally:
            self._handle.close()            # releases the flock
            self._handle = None


def lock_save_dir(save_dir: str | os.PathLike, run_id: str, *, world_group=None) -> SaveDirLock | None:
    """Take the lock of ``save_dir`` (created if missing) for the run ``run_id``: collective over
    ``world_group`` (None: one process); rank 0 takes and holds it (returned; None on the other ranks).
    Raises :class:`SaveDirBusyError` on every rank, naming the owner, when another live run holds it."""
    lock, error = None, None
    if comms.group_rank(world_group) == 0:
        try:
            lock = _lock(os.fspath(save_dir), run_id)
        except SaveDirBusyError as e:
            error = str(e)
    error = comms.all_gather_object(error, world_group)[0]
    if error is not None:
        raise SaveDirBusyError(error)
    return lock


def _lock(save_dir: str, run_id: str) -> SaveDirLock:
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, LOCK_FILE)
    handle = open(path, "a+", encoding="utf-8")
    try:
        owner = _read_owner(handle)
        host = socket.gethostname()
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SaveDirBusyError(
                f"--save-dir {save_dir} is in use by another training run, {_describe(owner)} (lock file {path}): "
                "wait for it to end, or give this run another --save-dir") from None
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # No flock on this filesystem: the recorded owner decides.
            live = owner is not None and (owner.get("host") != host or (
                _pid_alive(owner.get("pid")) and owner.get("pid") != os.getpid()))
            if live:
                raise SaveDirBusyError(
                    f"--save-dir {save_dir} is in use by another training run, {_describe(owner)} (lock file "
                    f"{path}; this filesystem has no flock, so a run of another host cannot be checked): wait for "
                    "it to end, or delete the lock file once it has") from None
        if owner is not None:
            logger.info("taking over the stale lock of %s on %s: that run is no longer running", _describe(owner),
                        save_dir)
        handle.seek(0)
        handle.truncate(0)
        handle.write(json.dumps({"host": host, "pid": os.getpid(), "run_id": run_id,
                                 "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
                                     timespec="seconds")}) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    except BaseException:
        handle.close()
        raise
    return SaveDirLock(path, handle)
