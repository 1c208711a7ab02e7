"""The pid files of pdsh launches, in a folder only their user can enter.

A pdsh launch cannot stop its nodes by closing a connection (as the ssh launcher does), so each node's
``microspeed run --pid-job JOB`` writes its pid to ``<private folder>/JOB.<host name>.pid`` and the stop command
(``microspeed run --stop-job JOB``, run on every node over pdsh) signals that pid. The private folder is
``$XDG_RUNTIME_DIR/microspeed`` where that is the user's own (a per-user tmpfs under systemd), else
``~/.cache/microspeed/run``; it is created ``0700`` and used only when it is a real folder (not a link), owned by
the user and closed to everyone else. The host name in the file name keeps nodes apart when the home folder is
shared (NFS). A fixed name in ``/tmp`` (``/tmp/microspeed-run-JOB.pid``, or DeepSpeed's ``/tmp/PID.deepspeed``)
lets another user of the node plant the file first (a symlink, or a pid of theirs to signal) or read the job's.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import stat

from microspeed.errors import ConfigError

_JOB = re.compile(r"[A-Za-z0-9_-]{1,64}")


class PidFileError(ConfigError):
    """The private folder of the pid files is not private, or a job name or pid file is malformed."""


def _private(folder: str) -> str:
    """``folder``, created ``0700`` when missing; a :class:`PidFileError` unless it is a real folder owned by
    this user with no access for others (``0700`` is restored on the user's own folder that is wider)."""
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        info = os.lstat(folder)
    except OSError as exc:
        raise PidFileError(f"cannot create the pid-file folder {folder}: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise PidFileError(f"the pid-file folder {folder} is not a folder of this user (a link, or another user's): "
                           f"remove it, or set XDG_RUNTIME_DIR to a private folder")
    if info.st_mode & 0o077:
        os.chmod(folder, 0o700)
    return folder


def private_folder(environ: dict[str, str] | None = None) -> str:
    """This user's folder for pid files (see the module docstring), created and checked."""
    environ = dict(os.environ if environ is None else environ)
    runtime = environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime):
        try:
            info = os.lstat(runtime)
        except OSError:
            info = None
        if info is not None and stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022:
            return _private(os.path.join(runtime, "microspeed"))
    home = environ.get("HOME") or os.path.expanduser("~")
    return _private(os.path.join(home, ".cache", "microspeed", "run"))


def pid_path(job: str, environ: dict[str, str] | None = None) -> str:
    """Where this node's pid file of ``job`` is (its folder created and checked)."""
    if not _JOB.fullmatch(job):
        raise PidFileError(f"--pid-job/--stop-job {job!r}: a job name is 1-64 letters, digits, '-' or '_'")
    return os.path.join(private_folder(environ), f"{job}.{socket.gethostname()}.pid")


def write_pid(job: str, pid: int | None = None, environ: dict[str, str] | None = None) -> str:
    """Write ``pid`` (default: this process's) as ``job``'s pid file, a new ``0600`` file (a file or link already
    there is refused: pid files are never reused); returns its path."""
    path = pid_path(job, environ)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise PidFileError(f"the pid file {path} already exists: another launch used job name {job!r}") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(f"{os.getpid() if pid is None else pid}\n")
    return path


def remove_pid(job: str, environ: dict[str, str] | None = None) -> None:
    """Remove ``job``'s pid file on this node when it is there."""
    try:
        os.unlink(pid_path(job, environ))
    except (FileNotFoundError, PidFileError):
        pass


def stop_job(job: str, environ: dict[str, str] | None = None, sig: int = signal.SIGTERM) -> int | None:
    """Send ``sig`` to the pid in ``job``'s pid file on this node and remove the file; the pid, or ``None`` when
    there is no pid file (the node's run ended). A file that is not one line holding a pid is an error naming it."""
    path = pid_path(job, environ)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PidFileError(f"cannot read the pid file {path}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, encoding="utf-8") as f:
        text = f.read(32).strip()
    if not text.isdigit() or int(text) <= 1:
        raise PidFileError(f"the pid file {path} does not hold a pid ({text!r}): remove it")
    pid = int(text)
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
    try:
        os.unlink(path)
    except FileNotFoundError:  # the node's run removed it as it ended
        pass
    return pid
