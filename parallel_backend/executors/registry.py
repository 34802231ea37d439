"""Executor names, the default executor and ``use_executor``.

Built-in names map to core classes; plugins (dask, device, third parties) add
theirs through the ``parallel_backend.executors`` entry-point group, loaded only
when a name is asked for.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import threading
from collections.abc import Iterator
from importlib.metadata import entry_points
from typing import Any

from .base import Executor
from .serial import SerialExecutor
from .thread import ThreadExecutor

__all__ = [
    "get_default_executor",
    "get_executor_class",
    "known_executors",
    "make_executor",
    "named_executor",
    "resolve_executor",
    "set_default_executor",
    "use_executor",
]

_BUILTIN = {"serial": SerialExecutor, "thread": ThreadExecutor}
_GROUP = "parallel_backend.executors"


def _plugins() -> dict:
    return {ep.name: ep for ep in entry_points(group=_GROUP)}


def known_executors() -> list[str]:
    """Every executor name, built-in or from an installed plugin."""
    return sorted(set(_BUILTIN) | set(_plugins()))


def get_executor_class(name: str) -> type[Executor]:
    """The executor class registered as ``name``.

    Raises
    ------
    ValueError
        For an unknown name; the message lists the known ones.
    """
    if name in _BUILTIN:
        return _BUILTIN[name]
    ep = _plugins().get(name)
    if ep is None:
        raise ValueError(f"unknown executor {name!r}; known: {known_executors()}")
    return ep.load()


def make_executor(name: str, **kwargs: Any) -> Executor:
    """Make an executor by name, e.g. ``make_executor("thread", workers=2)``."""
    return get_executor_class(name)(**kwargs)


_named: dict[str, Executor] = {}  # name -> the one executor of that name in this process
_named_lock = threading.Lock()


def named_executor(name: str) -> Executor:
    """The one executor of this process for ``name`` (``executor="thread"``,
    ``use_executor("dask")``): made with default settings on first use, made again only
    after it was closed, and closed at exit. A model traced again and again under a name
    reuses it: no thread pool or cluster per trace.

    Examples
    --------
    >>> named_executor("serial") is named_executor("serial")
    True
    """
    with _named_lock:
        ex = _named.get(name)
        if ex is None or ex.closed:
            ex = _named[name] = make_executor(name)
        return ex


@atexit.register
def _close_named() -> None:
    with _named_lock:
        made = list(_named.values())
        _named.clear()
    for ex in made:
        with contextlib.suppress(Exception):  # at exit, a failing close must not hide others
            ex.close()


_default: Executor | None = None
_current: contextvars.ContextVar[Executor | None] = contextvars.ContextVar(
    "parallel_backend_executor", default=None)


def set_default_executor(executor: Executor | str | None) -> None:
    """Set the executor used where neither ``executor=`` nor ``use_executor`` says.

    ``None`` restores the built-in default, a :class:`SerialExecutor`. A name
    (``"thread"``) makes an executor of that kind with default settings.
    """
    global _default
    _default = None if executor is None else _coerce(executor, "set_default_executor")


def get_default_executor() -> Executor:
    """The process-wide default (a :class:`SerialExecutor` unless set)."""
    global _default
    if _default is None:
        _default = SerialExecutor()
    return _default


@contextlib.contextmanager
def use_executor(executor: Executor | str) -> Iterator[Executor]:
    """Make ``executor`` the default for ``reduce_sum`` calls traced inside the block.

    The setting is per thread (and per asyncio task) and nests.

    Examples
    --------
    >>> import jax.numpy as jnp, parallel_backend as pb
    >>> with pb.ThreadExecutor(2) as ex, pb.use_executor(ex):
    ...     float(pb.reduce_sum(lambda x: x, jnp.ones(3)))
    3.0
    """
    ex = _coerce(executor, "use_executor")
    token = _current.set(ex)
    try:
        yield ex
    finally:
        _current.reset(token)


def resolve_executor(executor: Executor | str | None = None) -> Executor:
    """``executor`` if given, else the innermost ``use_executor``, else the default."""
    if executor is not None:
        return _coerce(executor, "executor")
    return _current.get() or get_default_executor()


def _coerce(executor: object, where: str) -> Executor:
    if isinstance(executor, Executor):
        return executor
    if isinstance(executor, str):
        return named_executor(executor)
    raise TypeError(f"{where}: expected an Executor or an executor name "
                    f"(one of {known_executors()}), got {type(executor).__name__}")
