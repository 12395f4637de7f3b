"""Output files of the command line: whole or not at all, and only ever regular files.

NOTE [output targets]: ``write_atomic`` writes a temporary file beside the target and renames
it over the target, so that a reader never sees half a file. A rename replaces whatever the
name stood for: run as root, ``--json /dev/null`` once turned ``/dev/null`` into a regular
file. So the target is looked at first. A missing name or a regular file is replaced
atomically (a symbolic link is followed: its target is replaced and the link stays, as
``open(path, "w")`` would). Anything else is refused: a folder with the error a rename onto
it gives (``IsADirectoryError``), a FIFO, a socket or a device with an ``OSError`` that says
what it is. Writing into a device in place is no way out: opening some devices has effects
of its own (a watchdog arms itself), and a FIFO without a reader blocks the writer for ever.
The command line refuses such paths before the sweep runs (``cli._output_path``); this is
the last guard, for a path that changed while the sweep ran. The look and the rename are
not one atomic step: a name swapped in between is not caught.
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

__all__ = ["check_output_path", "chmod_like_open", "write_atomic", "write_json"]


def write_json(path: str, data: Mapping[str, Any]) -> None:
    """Write ``data`` as indented JSON with ``write_atomic``.

    Raises:
        OSError: The folder does not exist or is not writable, or the target exists and is
            not a regular file (NOTE [output targets]).

    """
    write_atomic(path, (json.dumps(data, indent=2, sort_keys=False) + "\n").encode())


def write_atomic(path: str, payload: bytes) -> None:
    """Write a file so that a reader never sees half of it (temporary name, then rename).

    Raises:
        OSError: The target exists and is not a regular file (NOTE [output targets]), or the
            write failed.

    """
    _refuse_non_regular(path)
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


def _refuse_non_regular(path: str) -> None:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return  # a new file (or a dangling link, whose target is created)
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    kinds = (
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    kind = next((name for test, name in kinds if test(mode)), "not a regular file")
    raise OSError(f"it is {kind}, not a regular file: leakcheck replaces regular files only")


def _take_mode_of(target: str, temp_path: str) -> None:
    """Give the new file the mode and owner an existing target has, else a new file's mode.

    As writing the file in place would leave them (a private file stays private). The target
    is replaced, not written: a read-only target the folder lets us replace is replaced, and
    keeps its read-only mode.
    """
    try:
        existing = os.stat(target)
    except FileNotFoundError:
        chmod_like_open(temp_path)
        return
    # Owner first: chown clears the set-user-ID and set-group-ID bits that chmod then sets.
    if (existing.st_uid, existing.st_gid) != (os.geteuid(), os.getegid()):
        # Root gives a file away; any user may at least keep a group of their own.
        for uid in (existing.st_uid, -1):
            try:
                os.chown(temp_path, uid, existing.st_gid)
                break
            except OSError:
                continue
    os.chmod(temp_path, stat.S_IMODE(existing.st_mode))


def chmod_like_open(path: str) -> None:
    """Give a ``mkstemp`` file (mode 0600) the mode ``open()`` would have given it."""
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    # /proc tells without changing it; os.umask() must set it to read it, which is racy
    # while other threads create files.
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def environment(devices: Iterable[DeviceState] = (), **extra: Any) -> dict[str, Any]:
    """Versions and machine, written beside results (torch only if already imported).

    Args:
        devices: The GPUs the results are about.
        extra: More facts for the record (``leakcheck run`` adds the interpreter).

    """
    import leakcheck

    torch = sys.modules.get("torch")
    return {
        "leakcheck": leakcheck.__version__,
        "python": platform.python_version(),
        "torch": getattr(torch, "__version__", None) if torch is not None else None,
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "gpus": [device.name for device in devices],
        **extra,
    }


def check_output_path(text: str | None, option: str, suffix: str | None = None) -> str | None:
    """Check an output path before the work runs, so that its results are not lost.

    The folder must exist and take a new file (a probe file is created and removed: what
    the final atomic write does first), and a file already there must be a regular file
    that may be written (not a folder, a device, an immutable or append-only file).

    Returns:
        ``text``, or None when it is None.

    Raises:
        UsageError: One line naming ``option``, what was expected, and the value.

    """
    if text is None:
        return None
    if not text.strip():
        raise UsageError(f"{option}: expected a file path, got {text!r}")
    if text == "-":
        # Standard output is taken: sweep's table is written there, and under `run` the
        # program's own output.
        raise UsageError(
            f"{option}: expected a file path, got '-' (standard output is not written to; "
            "give a file name)"
        )
    if suffix is not None and not text.lower().endswith(suffix):
        raise UsageError(f"{option}: expected a file name ending in {suffix}, got {text!r}")
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise UsageError(f"{option}: expected a path in an existing folder, got {text!r}")
    try:
        existing = os.stat(text)
    except FileNotFoundError:
        existing = None  # a dangling link too: the write replaces the link
    except OSError as exc:
        raise UsageError(f"{option}: cannot check {text!r}: {exc.strerror}") from None
    if existing is not None:
        if stat.S_ISDIR(existing.st_mode):
            raise UsageError(f"{option}: expected a file path, got the folder {text!r}")
        if not stat.S_ISREG(existing.st_mode):
            raise UsageError(
                f"{option}: expected a regular file to write, got {text!r} (not a regular file)"
            )
        # Opening for writing, without truncating, changes nothing, and is refused where
        # os.access() says yes to root: immutable and append-only files, read-only mounts.
        try:
            os.close(os.open(text, os.O_WRONLY | os.O_CLOEXEC | os.O_NOCTTY))
        except OSError as exc:
            raise UsageError(
                f"{option}: expected a writable file, got {text!r} ({exc.strerror})"
            ) from None
    try:
        handle, probe = tempfile.mkstemp(prefix=".leakcheck-probe-", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise UsageError(
            f"{option}: expected a path in a folder that takes new files, got {text!r} "
            f"(cannot create a file in {folder}: {exc.strerror})"
        ) from None
    os.close(handle)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return text
