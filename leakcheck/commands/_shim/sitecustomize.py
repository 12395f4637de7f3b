"""``leakcheck run``'s startup shim: every Python process of the run imports it at startup.

NOTE [run shim]: ``leakcheck run`` puts this folder first on the program's ``PYTHONPATH``,
so Python's ``site`` imports this file as ``sitecustomize`` in the program and in every
Python process it starts that inherits the environment (not under ``python -E``, ``-I`` or
``-S``). It must cost next to nothing and change nothing the program can notice, so it:

1. takes its folder off ``sys.path`` again and runs the ``sitecustomize`` it shadows (the
   next one on the path), as ``site`` would have, which then is ``sys.modules
   ["sitecustomize"]``;
2. does nothing else unless ``LEAKCHECK_RUN`` names an existing folder (the run's), and
   nothing at all in multiprocessing's own children (spawn and forkserver workers, the
   resource tracker): a DataLoader worker is tracked by its loader's tracker, not by a
   tracker of its own;
3. never imports torch or leakcheck at startup: it puts a finder first on ``sys.meta_path``
   that waits for ``torch.utils.data.dataloader`` to be imported by the program, lets the
   import finish, then wraps ``DataLoader.__init__`` (to record the creation site, the
   program's own line) and ``DataLoader.__iter__`` (each iteration becomes an epoch of its
   loader: ``leakcheck.commands.instrument``, imported at the first iteration). The finder removes
   itself once it has seen that module.

A process forked from an activated one (not exec'd) stays inert: its loaders are untracked,
its parent's trackers are not its own. Nothing is imported here that the interpreter has
not loaded already; leakcheck is loaded from this file's own package when the first loader
is iterated, so the program runs the same leakcheck as the ``leakcheck run`` that started
it. Any failure of leakcheck's own leaves the program's DataLoader working as it would
without the shim.
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
_active_pid = 0  # the process that activated the shim; forked children stay inert
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


def _multiprocessing_child() -> bool:
    """A process multiprocessing started for itself (spawn/forkserver worker, helpers)."""
    argv = getattr(sys, "orig_argv", None) or []
    if "--multiprocessing-fork" in argv:
        return True
    if "-c" in argv:
        index = argv.index("-c")
        code = argv[index + 1] if index + 1 < len(argv) else ""
        return code.lstrip().startswith("from multiprocessing")
    return False


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
    original_init = cls.__init__
    original_iter = cls.__iter__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if os.getpid() == _active_pid and "_leakcheck_site" not in self.__dict__:
            with _suppress():
                self.__dict__["_leakcheck_site"] = _creation_site(self, torch_dir)

    def __iter__(self: Any) -> Any:
        if os.getpid() != _active_pid:
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


def _creation_site(loader: Any, torch_dir: str) -> tuple[str, int]:
    """The program's line that made ``loader``.

    The first frame out of torch and out of the ``__init__`` of the loader's own classes (a
    subclass's ``super().__init__`` call is not where the program made it).
    """
    inits = {
        getattr(klass.__dict__.get("__init__"), "__code__", None) for klass in type(loader).__mro__
    }
    frame = sys._getframe(2)  # above the patched __init__
    while frame is not None:
        code = frame.f_code
        if not (code.co_filename.startswith(torch_dir) or code in inits):
            return code.co_filename, frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return "?", 0


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
    global _active_pid, _active_folder
    folder = _run_folder()
    if folder is None or _multiprocessing_child():
        return
    _active_pid, _active_folder = os.getpid(), folder
    sys.meta_path.insert(0, _Finder())


sys.path[:] = [entry for entry in sys.path if not (isinstance(entry, str) and _same_dir(entry))]
with _suppress():
    _activate()
_chain()
