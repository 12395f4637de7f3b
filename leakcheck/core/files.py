"""Output files of the command line: whole or not at all, and only ever regular files.

NOTE [output targets]: ``write_atomic`` writes a temporary file beside the target and renames
it over the target, so that a reader never sees half a file. A rename replaces whatever the
name stood for (as root, ``--json /dev/null`` once made ``/dev/null`` a regular file), so only
a missing name or a regular file (a symbolic link followed) is replaced, anything else refused;
writing into a device in place is no way out (a watchdog arms itself, a FIFO blocks for ever).
``check_output_path`` refuses such paths before the work runs; this is the last guard.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import platform
import socket
import stat
import sys
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

from leakcheck.core.errors import UsageError
from leakcheck.core.model import DeviceState

__all__ = ["check_output_path", "environment", "write_atomic", "write_json"]


def write_json(path: str, data: Mapping[str, Any]) -> None:
    """Write ``data`` as indented JSON with ``write_atomic`` (NOTE [output targets])."""
    write_atomic(path, (json.dumps(data, indent=2, sort_keys=False) + "\n").encode())


def write_atomic(path: str, payload: bytes) -> None:
    """Write a file so that a reader never sees half of it (NOTE [output targets]).

    Raises:
        OSError: The target exists and is not a regular file, or the write failed.

    """
    with contextlib.suppress(FileNotFoundError):  # a new file, or a dangling link's target
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(mode):
            kinds = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket"}
            kinds |= {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}
            kind = kinds.get(stat.S_IFMT(mode), "not a regular file")
            raise OSError(
                f"it is {kind}, not a regular file: leakcheck replaces regular files only"
            )
    target = os.path.realpath(path)
    folder = os.path.dirname(target)
    handle, temp_path = tempfile.mkstemp(prefix=".leakcheck-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(payload)
        _take_mode_of(target, temp_path)
        os.replace(temp_path, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp_path)
        raise


def _take_mode_of(target: str, temp_path: str) -> None:
    """Give the new file the target's mode and owner, else the mode ``open()`` would give."""
    try:
        existing = os.stat(target)
    except FileNotFoundError:
        # /proc tells the umask; os.umask() must set it to read it (racy with threads).
        with open("/proc/self/status", encoding="ascii") as status:
            found = (int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
            umask = next(found, 0o022)  # a kernel before 4.7 has no Umask line: the usual one
        os.chmod(temp_path, 0o666 & ~umask)
        return
    # Owner first: chown clears the set-user-ID and set-group-ID bits that chmod then sets.
    if (existing.st_uid, existing.st_gid) != (os.geteuid(), os.getegid()):
        # Root gives a file away; any user may at least keep a group of their own.
        for uid in (existing.st_uid, -1):
            with contextlib.suppress(OSError):
                os.chown(temp_path, uid, existing.st_gid)
                break
    os.chmod(temp_path, stat.S_IMODE(existing.st_mode))


def environment(devices: Iterable[DeviceState] = (), **extra: Any) -> dict[str, Any]:
    """Versions and machine, written beside results (torch only if already imported)."""
    import leakcheck

    return {
        "leakcheck": leakcheck.__version__,
        "python": platform.python_version(),
        "torch": getattr(sys.modules.get("torch"), "__version__", None),
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "gpus": [device.name for device in devices],
        **extra,
    }


def check_output_path(text: str | None, option: str, suffix: str | None = None) -> str | None:
    """Check an output path before the work runs, so that its results are not lost.

    The folder must take a new file (a probe is created and removed), and a file already
    there must be a regular file that may be written.

    Raises:
        UsageError: One line naming ``option``, what was expected, and the value.

    """

    def refused(expected: str, why: str = "", got: str | None = None) -> UsageError:
        return UsageError(f"{option}: expected {expected}, got {got or repr(text)}{why}")

    if text is None:
        return None
    if not text.strip():
        raise refused("a file path")
    if text == "-":  # standard output is taken (sweep's table, run's program)
        raise refused("a file path", " (standard output is not written to; give a file name)")
    if suffix is not None and not text.lower().endswith(suffix):
        raise refused(f"a file name ending in {suffix}")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise refused("a path in an existing folder")
    try:
        existing = os.stat(text)
    except FileNotFoundError:
        existing = None  # a dangling link too: the write replaces the link
    except OSError as exc:
        raise UsageError(f"{option}: cannot check {text!r}: {exc.strerror}") from None
    if existing is not None:
        if stat.S_ISDIR(existing.st_mode):
            raise refused("a file path", got=f"the folder {text!r}")
        if not stat.S_ISREG(existing.st_mode):
            raise refused("a regular file to write", " (not a regular file)")
        # Opening without truncating changes nothing, and is refused where os.access() says
        # yes to root: immutable and append-only files, read-only mounts.
        try:
            os.close(os.open(text, os.O_WRONLY | os.O_CLOEXEC | os.O_NOCTTY))
        except OSError as exc:
            raise refused("a writable file", f" ({exc.strerror})") from None
    try:
        handle, probe = tempfile.mkstemp(prefix=".leakcheck-probe-", suffix=".tmp", dir=folder)
    except OSError as exc:
        why = f" (cannot create a file in {folder}: {exc.strerror})"
        raise refused("a path in a folder that takes new files", why) from None
    os.close(handle)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return text
