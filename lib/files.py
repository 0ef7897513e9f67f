"""
How our outputs reach the disk safely. One writer per folder: prepare.py and train.py (its master) hold an
exclusive lock, fcntl.flock on FOLDER/.lock (holding the writer's name and pid), on the folder they write, so that a
second run into it is refused at once; the OS drops the lock when the process ends, however it ends. Every finished
output (datasets, checkpoints, exports) takes its name with durable_replace once its bytes are on the disk, so that
a crash leaves the old one or the new one, whole. And nothing is written through a symbolic link the project did not
make (open_own): a downloaded folder may hold one planted where we write (out/metrics.jsonl -> ~/.bashrc).

    held = lock_folder("out", "train.py")        # UserError if another process writes out/ now
    durable_replace("out/ckpt.pt.tmp", "out/ckpt.pt")
    unlock_folder("out", held)                   # or let the process end
"""

import contextlib
import errno
import fcntl
import os

from lib.errors import UserError

LOCK_NAME = ".lock"


def lock_folder(folder, writer):
    """Lock folder (made if missing) for this process; returns what unlock_folder takes. UserError in one line,
    naming the process that holds it, when another process does."""
    path = os.path.join(folder, LOCK_NAME)
    while True:
        try:
            os.makedirs(folder, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UserError(link_refused(path)) from None
            raise UserError(f"cannot write in {folder} ({e.strerror}): choose a folder this user can write to, "
                             f"on a disk that is mounted") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise UserError(f"{folder} is being written by {holder}: wait for it to finish, or write into "
                             f"another folder") from None
        # the holder may have removed the file (unlock_folder) between our open and our lock: the lock is then on a
        # file no one else can see, and we try again with the new one
        with contextlib.suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{writer} (pid {os.getpid()})\n".encode(), 0)
    return fd


def link_refused(path):
    return f"{path} is a symbolic link, which this project never writes through: remove it, or choose another folder"


def open_own(path, mode="w", encoding=None):
    """open(path, mode) for a file this project writes, never following a link at path. 'w' modes (and 'w+b')
    replace whatever is there, a planted link included (the link goes, not the file it names), with a new file;
    'a' appends to a regular file and refuses a link in one line."""
    flags = os.O_NOFOLLOW | (os.O_RDWR if "+" in mode else os.O_WRONLY)
    if mode.startswith("a"):
        flags |= os.O_APPEND | os.O_CREAT
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        flags |= os.O_CREAT | os.O_EXCL  # a link planted again since the removal is refused, not followed
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(link_refused(path)) from None
        raise
    return os.fdopen(fd, mode, encoding=encoding)


def unlock_folder(folder, fd):
    # the lock file goes first, while still held, so that no one locks it after we let go of it
    with contextlib.suppress(FileNotFoundError):  # the folder went with it
        os.remove(os.path.join(folder, LOCK_NAME))
    os.close(fd)


def durable_replace(src, dst):
    """Rename src to dst (a file or a folder, replacing a file) and make the rename itself survive a power cut:
    the folder that holds the name is synced too."""
    os.replace(src, dst)
    try:
        folder = os.open(os.path.dirname(os.path.abspath(dst)), os.O_RDONLY)
    except OSError:  # a platform that cannot open folders (Windows): the rename is all there is
        return
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
