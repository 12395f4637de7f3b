"""``leakcheck run``'s startup shim: every Python process of the run imports it at startup.

NOTE [run shim]: ``leakcheck run`` puts this folder first on the program's ``PYTHONPATH``,
so Python's ``site`` imports this file as ``sitecustomize`` in the program and in every
Python process it starts that inherits the environment (not under ``python -E``, ``-I`` or
``-S``). It must cost next to nothing and change nothing the program can notice, so it:

1. takes its folder off ``sys.path`` again and runs the ``sitecustomize`` it shadows (the
   next one on the path), as ``site`` would have, which then is ``sys.modules
   ["sitecustomize"]``;
2. does nothing else unless ``LEAKCHECK_RUN`` names an existing folder (the run's);
3. never imports torch or leakcheck at startup: it puts a finder first on ``sys.meta_path``
   that waits for ``torch.utils.data.dataloader`` to be imported by the program, lets the
   import finish, then wraps ``DataLoader.__init__`` (to record the creation site: the
   user's own line, and the library that made the loader for it) and ``DataLoader.__iter__``
   (each iteration becomes an epoch of its loader: ``leakcheck.commands.instrument``,
   imported at the first iteration). The finder removes itself once it has seen that
   module.

Every Python process of the run tracks the loaders it iterates: the program, the processes
``multiprocessing`` and ``torch.multiprocessing`` start (spawned ones import this file at
their start; forked ones inherit it, and ``instrument`` resets what they inherited of their
parent's trackers), and exec'd ranks (torchrun, ``accelerate launch``). Left out:

* an iteration inside a DataLoader worker (``get_worker_info()`` is set there): the worker
  is its loader's tracker's to judge, and a loader of its own would judge its parent's;
* multiprocessing's helpers (the resource tracker, the forkserver process: told by their
  command line) never track; the processes the forkserver forks do, as any fork does.

Nothing is imported here that the interpreter has not loaded already; leakcheck is loaded
from this file's own package when the first loader is iterated, so the program runs the same
leakcheck as the ``leakcheck run`` that started it. Any failure of leakcheck's own leaves the
program's DataLoader working as it would without the shim.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing costs the program's start 2 ms: imported for mypy only
if TYPE_CHECKING:
    from typing import Any

RUN_ENV = "LEAKCHECK_RUN"
"""Names the run folder; the same as ``leakcheck.commands.instrument.RUN_ENV``."""

_TARGET = "torch.utils.data.dataloader"
_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = os.path.dirname(os.path.dirname(_HERE))  # the leakcheck package of this shim
_HELPERS = ("from multiprocessing.resource_tracker", "from multiprocessing.forkserver")
_helper_pid = 0  # a multiprocessing helper never tracks; what its forks run does
_active_folder = ""


def _same_dir(entry: str) -> bool:
    try:
        return os.path.abspath(entry or os.curdir) == _HERE
    except (TypeError, ValueError):
        return False


def _chain() -> None:
    """Import the ``sitecustomize`` this file shadows, with ``site``'s error handling.

    Plain ``__import__`` once this module left ``sys.modules`` and its folder left
    ``sys.path``: importing ``importlib.util`` here would cost the program milliseconds.
    """
    me = sys.modules.pop("sitecustomize", None)
    try:
        __import__("sitecustomize")
    except ImportError as error:
        if error.name != "sitecustomize":
            _site_error(error)
    except Exception as error:
        _site_error(error)
    if "sitecustomize" not in sys.modules and me is not None:
        # None other (or it failed): the import machinery expects this module back.
        sys.modules["sitecustomize"] = me


def _site_error(error: BaseException) -> None:
    """What ``site.execsitecustomize`` does with a failing ``sitecustomize``."""
    if sys.flags.verbose:
        sys.excepthook(type(error), error, error.__traceback__)
    else:
        sys.stderr.write(
            "Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
            f"{type(error).__name__}: {error}\n"
        )


def _multiprocessing_helper() -> bool:
    """The resource tracker or the forkserver process (``-c "from multiprocessing..."``)."""
    argv = getattr(sys, "orig_argv", None) or []
    if "-c" not in argv:
        return False
    index = argv.index("-c")
    code = argv[index + 1] if index + 1 < len(argv) else ""
    return code.lstrip().startswith(_HELPERS)


def _run_folder() -> str | None:
    folder = os.environ.get(RUN_ENV)
    if not folder or not os.path.isdir(folder):
        return None
    return folder


class _Finder:
    """Wait for torch's dataloader module, then patch it once it has run."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        with _suppress():
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


class _PatchingLoader:
    """A module loader that runs the real one, then patches the module it made."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        with _suppress():
            _patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename... for tracebacks
        return getattr(self._loader, name)


class _suppress:  # contextlib.suppress(Exception), without importing contextlib
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> bool:
        return kind is not None and issubclass(kind, Exception)


def _patch(module: Any) -> None:
    found = getattr(module, "DataLoader", None)
    if not isinstance(found, type) or found.__dict__.get("_leakcheck_patched"):
        return
    cls: Any = found
    torch_dir = os.path.dirname(os.path.dirname(os.path.dirname(module.__file__))) + os.sep
    worker_info = getattr(module, "get_worker_info", None) or (lambda: None)
    original_init = cls.__init__
    original_iter = cls.__iter__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if "_leakcheck_site" not in self.__dict__:
            with _suppress():
                self.__dict__["_leakcheck_site"] = _creation_site(self, torch_dir, cls)

    def __iter__(self: Any) -> Any:
        if os.getpid() == _helper_pid or worker_info() is not None:
            return original_iter(self)
        instrument = _instrument()
        if instrument is None:
            return original_iter(self)
        return instrument.epoch_iterator(self, original_iter)  # never raises its own errors

    wrappers: tuple[tuple[str, Any, Any], ...] = (
        ("__init__", __init__, original_init),
        ("__iter__", __iter__, original_iter),
    )
    for name, wrapper, original in wrappers:
        wrapper.__name__ = name
        wrapper.__qualname__ = original.__qualname__
        wrapper.__doc__ = original.__doc__
        wrapper.__wrapped__ = original
        setattr(cls, name, wrapper)
    cls._leakcheck_patched = True


_STDLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
_LIBRARY_DIRS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
# A spawned multiprocessing child runs multiprocessing's own ``-c`` code, not the user's.
_SPAWNED = "--multiprocessing-fork" in (getattr(sys, "orig_argv", None) or ())


def _library(filename: str) -> str | None:
    """The top-level package of a library's file; "" for the stdlib; None for user code.

    User code is any file out of the stdlib, site-packages, dist-packages and leakcheck
    (a ``python -c`` program's ``<string>`` too, but not the one multiprocessing gives a
    process it spawns; frozen modules are the stdlib's).
    """
    if not filename.startswith(os.sep):
        return "" if filename.startswith("<frozen") or _SPAWNED else None
    for marker in _LIBRARY_DIRS:
        index = filename.rfind(marker)
        if index >= 0:
            top = filename[index + len(marker) :].split(os.sep, 1)[0]
            return top[:-3] if top.endswith(".py") else top
    if filename.startswith(_PACKAGE + os.sep):
        return "leakcheck"
    return "" if filename.startswith(_STDLIB) else None


def _creation_site(loader: Any, torch_dir: str, cls: Any) -> tuple[Any, ...]:
    """Where ``loader`` was made: ``(file, line, via, origin file, origin line)``.

    ``file:line`` is the first frame of the user's own code out of torch (and out of the
    ``__init__`` of the loader's own classes: a subclass's ``super().__init__`` call is not
    where the program made it); ``via`` names the library that made the loader for it: the
    top-level package of the outermost library frame between that frame and torch, with
    its class where that frame is a method (``transformers Trainer``), else empty. The
    origin is the first frame out of torch, the user's or a library's: what made the loader
    itself.

    A library frame that holds the loader itself is part of making it (a wrapper of
    ``__init__``, as Lightning installs while it calls ``train_dataloader()``), not what
    made it: passed over like torch. One that holds another DataLoader with a site of its
    own is making this one from it (Lightning adds a ``DistributedSampler`` so, in a rank
    whose stack holds no user frame): the loader takes that site, by this library. Without
    a user frame at all (a library's own program) the origin is the site.
    """
    inits = {
        getattr(klass.__dict__.get("__init__"), "__code__", None) for klass in type(loader).__mro__
    }
    origin: tuple[str, int] | None = None
    outermost: Any = None  # the library frame nearest the user's, so far
    for frame in _outward(sys._getframe(2)):  # from the caller of the patched __init__
        code = frame.f_code
        filename = code.co_filename
        if filename.startswith(torch_dir) or code in inits:
            continue
        library = _library(filename)
        held = _held_loader(frame, loader, cls) if library else None
        if held is loader:
            continue
        if origin is None:
            origin = (filename, frame.f_lineno)
        if library is None:
            return (filename, frame.f_lineno, _via(outermost), *origin)
        if library:
            outermost = frame
            if held is not None:
                site = held.__dict__["_leakcheck_site"]
                return (*site[:2], site[2] or _via(frame), *origin)
    if origin is None:
        return ("?", 0, "", "?", 0)
    return (*origin, "", *origin)


def _outward(frame: Any) -> Any:
    """``frame`` and its callers, innermost first."""
    while frame is not None:
        yield frame
        frame = frame.f_back


def _held_loader(frame: Any, loader: Any, cls: Any) -> Any:
    """``loader`` where a frame's local holds it, else a DataLoader with a site, else None."""
    found = None
    for value in frame.f_locals.values():
        if value is loader:
            return loader
        if found is None and isinstance(value, cls):
            site = value.__dict__.get("_leakcheck_site")
            if isinstance(site, tuple) and len(site) >= 3:
                found = value
    return found


def _via(frame: Any) -> str:
    """``package`` or ``package Class`` of a library frame; empty for None."""
    if frame is None:
        return ""
    code = frame.f_code
    package = _library(code.co_filename) or ""
    parts = getattr(code, "co_qualname", "").split(".")  # Python 3.11+
    if len(parts) >= 2 and parts[1] != "<locals>" and parts[0].isidentifier():
        return f"{package} {parts[0]}"
    return package


_instrument_module: Any = None
_instrument_failed = False


def _instrument() -> Any:
    """``leakcheck.commands.instrument`` from this shim's package (None once it failed to load)."""
    global _instrument_module, _instrument_failed
    if _instrument_module is not None or _instrument_failed:
        return _instrument_module
    try:
        import importlib.util

        if "leakcheck" not in sys.modules:
            spec = importlib.util.spec_from_file_location(
                "leakcheck",
                os.path.join(_PACKAGE, "__init__.py"),
                submodule_search_locations=[_PACKAGE],
            )
            if spec is None or spec.loader is None:
                raise ImportError(f"no leakcheck package in {_PACKAGE}")
            package = importlib.util.module_from_spec(spec)
            sys.modules["leakcheck"] = package
            try:
                spec.loader.exec_module(package)
            except BaseException:
                del sys.modules["leakcheck"]
                raise
        import leakcheck.commands.instrument as instrument

        instrument.configure(_active_folder)
        _instrument_module = instrument
    except Exception as error:
        _instrument_failed = True
        sys.stderr.write(
            f"leakcheck run: DataLoaders of PID {os.getpid()} are not tracked: "
            f"{type(error).__name__}: {error}\n"
        )
    return _instrument_module


def _activate() -> None:
    global _helper_pid, _active_folder
    folder = _run_folder()
    if folder is None:
        return
    _active_folder = folder
    if _multiprocessing_helper():
        _helper_pid = os.getpid()
    sys.meta_path.insert(0, _Finder())


sys.path[:] = [entry for entry in sys.path if not (isinstance(entry, str) and _same_dir(entry))]
with _suppress():
    _activate()
_chain()
