"""An averager made without ``__init__``, for unit tests of one of its methods: no process, no DHT."""

from __future__ import annotations


def bare(cls: type):
    """An instance of a subclass of ``cls`` with no ``__init__`` run and no ``__del__``.

    hivemind's ``DecentralizedAverager.__del__`` reads attributes its ``__init__`` sets, so an averager made with
    ``object.__new__`` raises at whatever later garbage collection frees it. One such error, raised while
    ``ast.parse`` of another test ran (CI), made Python 3.11 fail that test with ``SystemError: AST constructor
    recursion depth mismatch``."""
    quiet = type(cls.__name__, (cls,), {"__del__": lambda self: None, "__module__": cls.__module__})
    return object.__new__(quiet)
