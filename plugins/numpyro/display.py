"""Where a long call shows its progress, as NumPyro's own bar does: on standard error.

:func:`display` tells the three places apart: a terminal (``sys.stderr`` is one: a tqdm
bar there), a Jupyter kernel (tqdm's notebook bar), and neither, a batch job or a pipe
(``python fit.py > log 2> err``): plain lines, one at each tenth of the work and one at its
end, written to standard error. Every line is also an INFO record on the caller's logger,
for a program that reads its logs; where logging already shows that record (a handler
takes INFO of that logger, as after ``logging.basicConfig(level=logging.INFO)``), the
line is not written a second time. :class:`Bar` is the counted bar of ``pb.profile`` and
``pb.log_likelihood``; ``pb.sample``'s own (``plugins/sample/progress.py``) shows more
and uses :func:`display` and :class:`Lines`. Imports tqdm (when a bar is drawn) and the
standard library.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings
from typing import IO, Any, Self

__all__ = ["DISPLAYS", "Bar", "Lines", "display", "in_notebook", "logged", "notebook_tqdm",
           "terminal"]

#: The places :func:`display` tells apart.
DISPLAYS = ("terminal", "notebook", "log")


def terminal(stream: IO[str] | None = None) -> bool:
    """Whether ``stream`` (default ``sys.stderr``, where the bar goes) is an interactive
    terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (IPython's kernel application runs it)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:  # noqa: BLE001 - a half-imported IPython is not a kernel
        return False
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


def display(stream: IO[str] | None = None) -> str:
    """Where progress can be seen: ``"terminal"`` (``stream``, default ``sys.stderr``, is
    one), ``"notebook"`` (a Jupyter kernel, whose streams are not terminals) or ``"log"``
    (neither: lines, see :class:`Lines`).

    >>> import io
    >>> display(io.StringIO())
    'log'
    """
    if terminal(stream):
        return "terminal"
    return "notebook" if in_notebook() else "log"


def logged(logger: logging.Logger, level: int = logging.INFO) -> bool:
    """Whether a record of ``level`` on ``logger`` reaches a handler that takes it (the
    application configured logging to show it).

    >>> logged(logging.getLogger("parallel_backend.example"))
    False
    """
    if not logger.isEnabledFor(level):
        return False
    current: logging.Logger | None = logger
    while current is not None:
        if any(h.level <= level for h in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


def notebook_tqdm() -> Any:
    """``tqdm.auto``'s class: the notebook widget with ipywidgets, a text bar without."""
    from tqdm import TqdmExperimentalWarning, TqdmWarning

    with warnings.catch_warnings():
        # tqdm warns that it falls back to text without ipywidgets, and that its notebook
        # mode is experimental: either bar works, and the warning would be the only thing
        # a user sees in the cell until the bar appears.
        warnings.simplefilter("ignore", TqdmWarning)
        warnings.simplefilter("ignore", TqdmExperimentalWarning)
        from tqdm.auto import tqdm
    return tqdm


class Lines:
    """Progress lines where no bar can be seen: an INFO record on ``logger``, and the same
    text on ``file`` (default ``sys.stderr`` when written) unless logging shows the record.

    Examples
    --------
    >>> import io
    >>> out = io.StringIO()
    >>> Lines(logging.getLogger("parallel_backend.example"), out)("%d of %d", 1, 4)
    >>> out.getvalue()
    '1 of 4\\n'
    """

    def __init__(self, logger: logging.Logger, file: IO[str] | None = None):
        self.logger = logger
        self.file = file

    def __call__(self, message: str, *args: Any) -> None:
        self.logger.info(message, *args)
        if not logged(self.logger):
            print(message % args if args else message, file=self.file or sys.stderr,
                  flush=True)


class Bar:
    """A counted progress bar over ``total`` steps of ``desc``; a context manager.

    A tqdm bar on a terminal (``file``, default ``sys.stderr``) or in Jupyter; elsewhere a
    line (:class:`Lines`) at the start, at each tenth and at the end.

    Parameters
    ----------
    total : int
        Steps of the work.
    desc : str
        What the work is, the start of every line.
    logger : logging.Logger
        Where the lines go as records.
    enabled : bool
        Show anything (``False``: nothing).
    file : stream, optional
        The terminal, or where lines go; default ``sys.stderr``.
    unit : str
        What a step is.

    Examples
    --------
    >>> import io
    >>> out = io.StringIO()
    >>> with Bar(4, "replay", logging.getLogger("parallel_backend.example"), file=out,
    ...          unit="chunk") as bar:
    ...     for _ in range(4):
    ...         bar.update()
    >>> print(out.getvalue().replace("0.0 s", "s"), end="")
    replay: 4 chunks
    replay: 1/4 chunks (25%), s
    replay: 2/4 chunks (50%), s
    replay: 3/4 chunks (75%), s
    replay: 4/4 chunks (100%), s
    """

    def __init__(self, total: int, desc: str, logger: logging.Logger, *, enabled: bool = True,
                 file: IO[str] | None = None, unit: str = "it"):
        self.total, self.desc, self.unit = max(int(total), 0), desc, unit
        self.enabled = bool(enabled)
        self.file = file
        self.count = 0
        self._lines = Lines(logger, file)
        self._bar: Any = None
        self._next = 0
        self._t0 = time.perf_counter()

    def __enter__(self) -> Self:
        if not self.enabled:
            return self
        where = display(self.file)
        if where == "terminal":
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=self.desc, unit=self.unit,
                             file=self.file or sys.stderr, mininterval=0.2, leave=True)
        elif where == "notebook":
            self._bar = notebook_tqdm()(total=self.total, desc=self.desc, unit=self.unit,
                                        file=self.file or sys.stderr, mininterval=0.5)
        else:
            self._lines("%s: %d %ss", self.desc, self.total, self.unit)
            self._next = self._tenth_after(0)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _tenth_after(self, count: int) -> int:
        total = max(self.total, 1)
        return -(-(count * 10 // total + 1) * total // 10)

    def update(self, n: int = 1, postfix: str = "") -> None:
        """``n`` more steps done; ``postfix``, figures to show beside the count."""
        self.count += n
        if not self.enabled:
            return
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(n)
        elif self.count >= self._next:
            self._next = self._tenth_after(self.count)
            self._lines("%s: %d/%d %ss (%d%%), %.1f s%s", self.desc, self.count, self.total,
                        self.unit, 100 * self.count // max(self.total, 1),
                        time.perf_counter() - self._t0, f", {postfix}" if postfix else "")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
