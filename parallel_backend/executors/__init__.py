"""Executors: who evaluates the chunks. Core executors only; plugins add more."""

from .base import Executor
from .registry import (
    get_default_executor,
    get_executor_class,
    known_executors,
    make_executor,
    resolve_executor,
    set_default_executor,
    use_executor,
)
from .serial import SerialExecutor
from .thread import ThreadExecutor

__all__ = [
    "Executor",
    "SerialExecutor",
    "ThreadExecutor",
    "get_default_executor",
    "get_executor_class",
    "known_executors",
    "make_executor",
    "resolve_executor",
    "set_default_executor",
    "use_executor",
]
