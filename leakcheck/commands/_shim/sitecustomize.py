"""``leakcheck run``'s startup shim: every Python process of the run imports it at startup.

NOTE [run shim]: ``leakcheck run`` puts this folder first on the program's ``PYTHONPATH``, so
``site`` imports this file in every Python process of the run (not under ``python -E``, ``-I``
or ``-S``). It costs next to nothing and changes nothing the program can notice: it takes its
folder off ``sys.path``, runs the ``sitecustomize`` it shadows, does nothing more without
``LEAKCHECK_RUN`` naming a folder, and imports nothing the interpreter has not loaded. A
finder waits for ``torch.utils.data.dataloader`` and wraps ``DataLoader.__init__`` (the
creation site) and ``__iter__`` (NOTE [run instrumentation]), except in DataLoader workers and
multiprocessing's helpers. A failure leaves DataLoader as is.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # importing typing slows every program's start: for mypy only
if TYPE_CHECKING:
    from typing import Any

RUN_ENV = "LEAKCHECK_RUN"  # instrument.RUN_ENV
_TARGET = "torch.utils.data.dataloader"
_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = os.path.dirname(os.path.dirname(_HERE))  # the leakcheck package of this shim
_HELPERS = ("from multiprocessing.resource_tracker", "from multiprocessing.forkserver")
_STDLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
_LIBRARY_DIRS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
# A spawned multiprocessing child runs multiprocessing's own ``-c`` code, not the user's.
_SPAWNED = "--multiprocessing-fork" in (getattr(sys, "orig_argv", None) or ())
_helper_pid = 0  # a multiprocessing helper never tracks; what its forks run does
_active_folder = ""
_instrument_module: Any = None  # False once it failed


class _suppress:  # contextlib.suppress(Exception), without importing contextlib
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> bool:
        return kind is not None and issubclass(kind, Exception)


def _same_dir(entry: str) -> bool:
    try:
        return os.path.abspath(entry or os.curdir) == _HERE
    except (TypeError, ValueError):
        return False


def _chain() -> None:
    """Run the ``sitecustomize`` this file shadows, as ``site`` would have."""
    me = sys.modules.pop("sitecustomize", None)
    sys.modules["site"].execsitecustomize()  # site is importing this file
    if "sitecustomize" not in sys.modules and me is not None:
        sys.modules["sitecustomize"] = me  # none other: the import machinery expects one


class _Finder:
    """Wait for torch's dataloader module; patch it once it has run."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != _TARGET:
            return None
        with _suppress():
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            spec = find_spec(fullname, path, target) if find_spec is not None else None
            if spec is not None:
                with _suppress():  # a loader that takes no attribute: DataLoader stays as is
                    spec.loader.exec_module = _patching(spec.loader.exec_module)
                return spec
        return None


def _patching(exec_module: Any) -> Any:
    def exec_and_patch(module: Any) -> None:
        exec_module(module)
        if module.__name__ == _TARGET:  # the loader may serve other modules too
            with _suppress():
                _patch(module)

    return exec_and_patch


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

    import functools  # torch imported it already

    for wrapper, original in ((__init__, original_init), (__iter__, original_iter)):
        setattr(cls, wrapper.__name__, functools.wraps(original)(wrapper))
    cls._leakcheck_patched = True


def _library(filename: str) -> str | None:
    """The top-level package of a library's file; "" for the stdlib; None for user code."""
    if not filename.startswith(os.sep):
        return "" if filename.startswith("<frozen") or _SPAWNED else None
    for marker in _LIBRARY_DIRS:
        index = filename.rfind(marker)
        if index >= 0:
            top = filename[index + len(marker) :].split(os.sep, 1)[0]
            return top.removesuffix(".py")
    if filename.startswith(_PACKAGE + os.sep):
        return "leakcheck"
    return "" if filename.startswith(_STDLIB) else None


def _creation_site(loader: Any, torch_dir: str, cls: Any) -> tuple[Any, ...]:
    """Where ``loader`` was made: ``(file, line, via, origin file, origin line)``.

    The user's first frame out of torch and the loader's ``__init__``s, ``via`` the outermost
    library between (``transformers Trainer``); the origin: the first frame out of torch. A
    library frame holding the loader is passed over (Lightning's ``__init__`` wrapper); one
    holding another loader with a site gives that site (Lightning's ``DistributedSampler``).
    """
    inits = {getattr(k.__dict__.get("__init__"), "__code__", None) for k in type(loader).__mro__}
    origin: tuple[str, int] | None = None
    outermost: Any = None  # the library frame nearest the user's, so far
    frame: Any = sys._getframe(2)  # the caller of the patched __init__
    while frame is not None:
        code = frame.f_code
        filename = code.co_filename
        if not (filename.startswith(torch_dir) or code in inits):
            library = _library(filename)
            held = _held_loader(frame, loader, cls) if library else None
            if held is not loader:
                origin = origin or (filename, frame.f_lineno)
                if library is None:
                    return (filename, frame.f_lineno, _via(outermost), *origin)
                if library:
                    outermost = frame
                if held is not None:
                    site = held.__dict__["_leakcheck_site"]
                    return (*site[:2], site[2] or _via(frame), *origin)
        frame = frame.f_back
    return (*origin, "", *origin) if origin else ("?", 0, "", "?", 0)


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


def _instrument() -> Any:
    """``leakcheck.commands.instrument`` from this shim's package (None once it failed)."""
    global _instrument_module
    if _instrument_module is not None:
        return _instrument_module or None
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
        _instrument_module = False
        sys.stderr.write(
            f"leakcheck run: DataLoaders of PID {os.getpid()} are not tracked: "
            f"{type(error).__name__}: {error}\n"
        )
    return _instrument_module or None


def _activate() -> None:
    global _helper_pid, _active_folder
    folder = os.environ.get(RUN_ENV)
    if not folder or not os.path.isdir(folder):
        return
    _active_folder = folder
    argv = getattr(sys, "orig_argv", None) or []
    code = argv[argv.index("-c") + 1] if "-c" in argv[:-1] else ""
    if code.lstrip().startswith(_HELPERS):
        _helper_pid = os.getpid()
    sys.meta_path.insert(0, _Finder())


sys.path[:] = [entry for entry in sys.path if not (isinstance(entry, str) and _same_dir(entry))]
with _suppress():
    _activate()
_chain()
