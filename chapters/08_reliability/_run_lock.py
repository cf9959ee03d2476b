"""One run per save directory: a lock held for the life of the run (named on the page
chapters/08_reliability/restarts.py).

Two runs saving into one directory at once (a Slurm requeue while the old job still lives, a
command pasted twice) interleave their logs and overwrite each other's checkpoints, and both
exit 0. Global rank 0 takes an exclusive `flock` on `<save>/tinytron.lock` before anything of
the run is written and keeps the file open until the run ends; the file says who holds it. The
kernel drops a `flock` when its holder's last descriptor closes, also when the process is
killed (SIGKILL, the OOM killer), so a lock is never left behind by a dead run and no stale
lock needs breaking. (On a network file system `flock` is as good as the file system's own
locks: NFSv4 and Lustre with `flock` mounted support it.)
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from typing import IO

LOCK_NAME = "tinytron.lock"


def lock_save_dir(directory: str, what: str = "checkpoint.save") -> IO:
    """The open, flock-ed lock file of `directory`; a one-line ValueError naming the holder."""
    path = os.path.join(directory, LOCK_NAME)
    try:
        f = open(path, "a+")   # never truncates before the lock is ours: a holder's line stays
    except OSError as e:
        raise ValueError(f"{what} {directory}: cannot write {path} ({e.strerror})") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process that has not written its name yet"
        f.close()
        raise ValueError(f"{what} {directory} is in use by another run ({holder}; lock "
                         f"{path}): wait for it to end, stop it, or save elsewhere") from None
    except OSError:   # a file system without flock: the run goes on, unguarded
        return f
    f.seek(0)
    f.truncate()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())
    f.write(f"host {socket.gethostname()}, pid {os.getpid()}, started {started}\n")
    f.flush()
    return f
