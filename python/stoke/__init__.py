"""stoke: packed image datasets and a fast CPU loader, for your own training loop.

    import stoke
    ds = stoke.Dataset("train.lmdb")        # len(ds), ds.classes, ds.record(i)

    from stoke.torch import Loader           # PyTorch tensors, zero-copy
    for batch in Loader("train.lmdb", batch_size=256):
        images, labels = batch["images"], batch["labels"]

Datasets are made by `stoke pack` (the command line tool).
"""
import math
import numbers
import os
import re
from typing import Any, Callable, Dict, Optional, Union

from . import _stoke
from ._stoke import Dataset, __version__

try:  # numpy's bool is no int subclass; refuse it as a count, accept it as a flag
    from numpy import bool_ as _np_bool
except ImportError:  # pragma: no cover
    class _np_bool:  # type: ignore[no-redef]
        pass

__all__ = ["Dataset", "pack", "__version__"]


# pack's messages name its command-line flags; each one found is given in stoke.pack's spelling too.
_FLAG_ARGUMENTS = {"--overwrite": "overwrite=True", "--resume": "resume=True", "--report": "report=",
                   "--val-fraction": "val_fraction=", "--val-output": "val_output=", "--list": "list_file=",
                   "--index-intervals": "index_intervals=", "--no-paths": "store_paths=False",
                   "--max-side": "max_side=", "--quality": "quality=", "--threads": "threads=",
                   "--on-error": "on_error=", "--shuffle": "shuffle=True", "--seed": "seed=",
                   "--encoding": "encoding=", "--validate": "validate=", "--index": "index=",
                   "--commit-every": "commit_every="}


def _in_pack_spelling(message: str) -> str:
    named = []
    for flag in re.findall(r"--[a-z][a-z-]*", message):
        argument = _FLAG_ARGUMENTS.get(flag)
        if argument is not None and f"{flag} is {argument}" not in named:
            named.append(f"{flag} is {argument}")
    return f"{message} (in stoke.pack: {', '.join(named)})" if named else message


_PATHS = {"source", "output", "list_file", "val_output", "report"}
_FLAGS = {"shuffle", "resume", "overwrite", "store_paths"}
_WORDS = {"encoding", "on_error", "validate", "index"}


def _checked(name: str, value: Any) -> Any:
    """A pack option of the right type (paths as the file system's bytes), else a ValueError naming it."""
    def bad(expected: str) -> ValueError:
        return ValueError(f"stoke.pack: {name}={value!r}: expected {expected}")
    if name in _PATHS:
        if value is None and name not in ("source", "output"):
            return None
        try:
            path = os.fspath(value)
        except TypeError:
            raise bad("a path (str, bytes or path-like)") from None
        encoded = os.fsencode(path)  # the file system's bytes, in whatever encoding they are
        if b"\0" in encoded:  # the system calls would stop at it: another file
            raise bad("a path without NUL bytes")
        return encoded
    if name in _FLAGS:
        if not isinstance(value, (bool, _np_bool)):
            raise bad("True or False")
        return bool(value)
    if name in _WORDS:
        if not isinstance(value, str):
            raise bad("a str")
        return value
    if name == "val_fraction":  # numpy's numbers too
        if isinstance(value, (bool, _np_bool)) or not isinstance(value, numbers.Real):
            raise bad("a number in [0, 1)")
        try:
            fraction = float(value)
        except OverflowError:
            fraction = math.inf
        if not 0 <= fraction < 1:
            raise bad("a number in [0, 1)")
        return fraction
    # seed, threads, max_side, quality, index_intervals, commit_every: whole numbers >= 0 (their
    # ranges are checked by stoke)
    limit = 2**64 if name == "seed" else 2**31
    if isinstance(value, (bool, _np_bool)) or not isinstance(value, numbers.Integral) or not 0 <= value < limit:
        raise bad(f"an int in [0, {limit})")
    return int(value)


_Path = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]


def pack(source: _Path, output: _Path, *, list_file: Optional[_Path] = None, val_fraction: float = 0.0,
         val_output: Optional[_Path] = None, shuffle: bool = False, seed: int = 0, threads: int = 0,
         max_side: int = 0, quality: int = 0, encoding: str = "jpeg", on_error: str = "skip",
         validate: str = "coefficients", index: str = "restart", index_intervals: int = 8,
         commit_every: int = 2048, resume: bool = False, overwrite: bool = False, store_paths: bool = True,
         report: Optional[_Path] = None, progress: Optional[Callable[[int], Any]] = None) -> Dict[str, Any]:
    """Packs an image folder tree (one folder per class) or a list file into a dataset, like
    ``stoke pack``, with the same options (``store_paths=False`` is ``--no-paths``). Returns the
    report: per split (train, val) inputs, records and bytes, and the inputs that were skipped with
    their reasons (``bad``).

    ``progress(records)`` is called with the records written so far after each commit (every
    ``commit_every`` records, or sooner once 32 MB are waiting) and with the total at the end (once). Ctrl-C stops
    at the next commit, leaving a partial dataset that ``resume=True`` continues. Errors raise with
    stoke's message.
    """
    options = dict(list_file=list_file, val_fraction=val_fraction, val_output=val_output, shuffle=shuffle,
                   seed=seed, threads=threads, max_side=max_side, quality=quality, encoding=encoding,
                   on_error=on_error, validate=validate, index=index, index_intervals=index_intervals,
                   commit_every=commit_every, resume=resume, overwrite=overwrite, store_paths=store_paths,
                   report=report)
    for name, value in options.items():
        options[name] = _checked(name, value)
    if options["val_output"] is not None and options["val_fraction"] == 0:
        raise ValueError(f"stoke.pack: val_output={val_output!r}: needs val_fraction > 0 (the share of each class "
                         "held out into it)")
    if progress is not None and not callable(progress):
        raise ValueError(f"stoke.pack: progress={progress!r}: expected a callable taking the records written")
    last = [-1]

    def told(records: int) -> Any:
        last[0] = records
        return progress(records)  # type: ignore[misc]

    try:
        report = _stoke._pack(_checked("source", source), _checked("output", output), options,
                              None if progress is None else told)
    except Exception as e:
        if len(e.args) == 1 and isinstance(e.args[0], str):
            e.args = (_in_pack_spelling(e.args[0]),)
        raise
    total = sum(split["records"] for split in report["splits"])
    if progress is not None and total != last[0]:
        progress(total)  # and once at the end, unless the last commit said it already
    return report
