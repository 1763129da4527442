"""The PyTorch adapter: stoke's loader as an iterable of dicts of torch tensors.

Batches are zero-copy views of the loader's ring buffers (through DLPack): a batch's buffer goes
back to the loader when the last tensor viewing it is freed. Keep a batch beyond the next
iteration with ``.clone()``. torch is imported when this module is.
"""
from __future__ import annotations

import collections.abc
import contextlib
import math
import numbers
import os
import re
import struct
import threading
import weakref
from typing import Any, Callable, Dict, Iterator, Optional, Tuple, Union

import torch
import torch.utils.dlpack
import torch.utils.data

from . import _stoke

try:  # numpy's bool is no int subclass; refuse it as a count, accept it as a flag
    from numpy import bool_ as np_bool
except ImportError:  # pragma: no cover - torch needs numpy in practice
    class np_bool:  # type: ignore[no-redef]
        pass

__all__ = ["Loader"]


def _rank_and_world(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    """Explicit values, else torch.distributed when initialised, else RANK/WORLD_SIZE, else 0/1."""
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        r, w = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        def from_env(name: str, default: int, wanted: bool) -> int:
            text = os.environ.get(name)
            if text is None or not wanted:  # a value passed wins: the variable is not read
                return default
            # Plain decimal digits only (int() would also take "1_0", "+1" or " 1 ").
            if re.fullmatch(r"[0-9]{1,10}", text) is None or int(text) >= _MAX_RANKS:
                raise ValueError(f"stoke.torch.Loader: the environment variable {name}={text!r} is not an int in "
                                 f"[0, {_MAX_RANKS})")
            return int(text)
        r, w = from_env("RANK", 0, rank is None), from_env("WORLD_SIZE", 1, world_size is None)
        if rank is None and "RANK" not in os.environ and (w if world_size is None else world_size) > 1:
            # Every process would take rank 0's shard: the same samples on every rank.
            given = f"world_size={world_size} was passed" if world_size is not None else f"WORLD_SIZE={w} is set"
            raise ValueError(f"stoke.torch.Loader: {given} but no rank; pass rank=, set RANK (as torchrun "
                             "does) or initialise torch.distributed")
        if world_size is None and "WORLD_SIZE" not in os.environ and rank is None and r > 0:
            raise ValueError(f"stoke.torch.Loader: RANK={r} is set but WORLD_SIZE is not; set WORLD_SIZE (as "
                             "torchrun does), pass world_size=, or initialise torch.distributed")
    chosen_rank, chosen_world = (r if rank is None else rank), (w if world_size is None else world_size)
    if (rank is None) != (world_size is None) and not 0 <= chosen_rank < chosen_world:
        # One from the caller, the other from torch.distributed or the environment: a mix that can
        # name a rank nobody chose. Say where each came from.
        source = "from torch.distributed" if torch.distributed.is_available() and torch.distributed.is_initialized() \
            else "from the environment"
        raise ValueError(f"stoke.torch.Loader: rank {chosen_rank} ({'passed' if rank is not None else source}) "
                         f"is not in [0, world_size {chosen_world}) ({'passed' if world_size is not None else source});"
                         " pass both rank= and world_size=, or neither")
    return chosen_rank, chosen_world


def _device_index(device: Union[str, "torch.device"]) -> int:
    """-1 for the host, else the GPU the batches go to; a clear error when there is none."""
    try:
        d = torch.device(device) if not isinstance(device, torch.device) else device
    except (RuntimeError, TypeError):
        d = None
    if d is not None and d.type == "cpu":
        return -1
    if d is None or d.type != "cuda":
        raise ValueError(f"stoke.torch.Loader: device {str(device)!r}: expected 'cpu', 'cuda' or 'cuda:N'")
    built, gpus, reason = _stoke._cuda()
    if not built:
        raise ValueError(f"stoke.torch.Loader: device {str(device)!r}: this stoke was built without CUDA; "
                         "use device='cpu' and .to(device, non_blocking=True)")
    if gpus == 0:
        raise ValueError(f"stoke.torch.Loader: device {str(device)!r}: stoke sees no GPU ({reason})")
    if not torch.cuda.is_available():
        raise ValueError(f"stoke.torch.Loader: device {str(device)!r}: torch sees no GPU ({reason or 'no CUDA device'})")
    index = torch.cuda.current_device() if d.index is None else d.index
    if not 0 <= index < min(gpus, torch.cuda.device_count()):
        raise ValueError(f"stoke.torch.Loader: device {str(device)!r}: there are {torch.cuda.device_count()} GPUs")
    return index


_MAX_RANKS = 2**31  # ranks and world sizes are C ints


def _local_processes() -> int:
    """The processes of this job on this machine, as its launcher says (1 without one)."""
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        text = os.environ.get(name)
        if text is None:
            continue
        if re.fullmatch(r"[0-9]{1,10}", text) is None or not 1 <= int(text) < _MAX_RANKS:
            raise ValueError(f"stoke.torch.Loader: the environment variable {name}={text!r} is not a number of "
                             f"processes in [1, {_MAX_RANKS}); pass threads= or unset it")
        return int(text)
    return 1
_MAX_EPOCH = 2**62  # epochs are numbered in int64, with room to count past the last


def _is_count(v: Any) -> bool:
    """A whole number >= 0: an int or numpy integer (not a bool, a float or a string)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np_bool)) and v >= 0


def _is_real(v: Any) -> bool:
    """A number: int, float or their numpy kinds (not a bool or a string)."""
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np_bool))


def _float(v: Any) -> float:
    """`v` (a number) as a float; an int past a float's range as inf of its sign (the range checks
    then name it), where float() raised OverflowError."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def _float32(v: float) -> float:
    """`v` rounded to float32 (inf past its range)."""
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def _scalar(v: Any) -> Any:
    """A 0-d tensor of numbers (what a tensor's elements are, one by one) as its Python number, so
    that tensors are taken where numbers are; anything else as it is."""
    if isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype != torch.bool and not v.is_complex():
        return v.item()
    return v


def _reals(v: Any, n: int) -> Optional[Tuple[float, ...]]:
    """`v` as n floats when it is a sequence (tuple, list, numpy array, tensor, ...) of n numbers,
    else None."""
    if isinstance(v, (str, bytes, collections.abc.Set, collections.abc.Mapping)):
        return None  # a set's or a dict's order is no channel order
    try:
        items = [_scalar(x) for x in v]
    except TypeError:
        return None
    return tuple(_float(x) for x in items) if len(items) == n and all(_is_real(x) for x in items) else None


def _checked_options(**options: Any) -> Dict[str, Any]:
    """Each Loader option of the type it needs, as plain Python values, else a ValueError naming it
    (the values' ranges are checked by stoke, which names them too)."""
    out: Dict[str, Any] = {}
    for name, value in options.items():
        value = _scalar(value)
        converted: Any = value
        if name in ("train", "drop_last"):
            ok, expected = isinstance(value, (bool, np_bool)), "True or False"
            converted = bool(value)
        elif name == "on_error":
            ok, expected = isinstance(value, str), "'skip' or 'fail'"
        elif name in ("rank", "world_size"):
            ok, expected = value is None or (_is_count(value) and value < _MAX_RANKS), f"None or an int in [0, {_MAX_RANKS})"
            converted = None if value is None or not ok else int(value)
        elif name == "seed":
            ok, expected = _is_count(value) and value < 2**64, "an int in [0, 2**64)"
            converted = int(value) if ok else value
        elif name == "scale":
            converted = _reals(value, 2)
            ok, expected = converted is not None, "two numbers (min, max)"
        elif name in ("flip", "max_skip_fraction"):
            ok, expected = _is_real(value), "a number in [0, 1]"
            converted = _float(value) if ok else value
        elif name == "normalize":
            mean_std = None
            if value is not None and not isinstance(value, (str, bytes)):
                try:
                    parts = list(value)
                except TypeError:
                    parts = []
                if len(parts) == 2:
                    mean_std = (_reals(parts[0], 3), _reals(parts[1], 3))
            ok = value is None or (mean_std is not None and None not in mean_std)
            expected = "None or ((mean r, g, b), (std r, g, b))"
            converted = mean_std if value is not None else None
            if ok and mean_std is not None:
                # The loader holds them as float32: a std of 1e-46 became 0 and 1e300 inf, and were
                # reported as such, not as the values given.
                for part, values in zip(("mean", "std"), mean_std):
                    for i, v in enumerate(values):
                        f32 = _float32(v)
                        if math.isfinite(v) and (not math.isfinite(f32) or (f32 == 0) != (v == 0)):
                            raise ValueError(f"stoke.torch.Loader: normalize: {part}[{i}] = {v!r} is "
                                             f"{f32} as a float32 (the loader's precision); expected a number "
                                             "float32 holds")
        else:  # batch_size, size, threads, ring, resize: whole numbers
            ok, expected = _is_count(value) and value < 2**31, "an int in [0, 2**31)"
            converted = int(value) if ok else value
        if not ok:
            raise ValueError(f"stoke.torch.Loader: {name}={value!r}: expected {expected}")
        out[name] = converted
    return out


def _no_epoch() -> None:
    """What Loader._current returns before the first iter() and after close()."""
    return None


class _Epoch:
    """The iterator of one epoch (what ``iter(loader)`` returns): exactly ``len(loader)`` batches,
    less those already handed out when resuming."""

    def __init__(self, owner: "Loader", native: Any, epoch: int, start: int) -> None:
        self._owner = owner
        self._native = native
        self.epoch = epoch
        self.yielded = start  # batches of this epoch handed to the user (resume counts from here)
        self.superseded = False  # a later iter() of the loader started another epoch before this one ended
        self.counts = True  # its batches move the loader's state_dict() (until set_epoch / load_state_dict)
        self._busy = threading.Lock()  # one next() at a time

    def __iter__(self) -> "_Epoch":
        return self

    def __next__(self) -> Dict[str, Any]:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("stoke.torch.Loader: next() of this epoch's iterator is already running in another "
                               "thread; take batches from one thread (the loader decodes on its own threads)")
        try:
            return self._next()
        finally:
            self._busy.release()

    def _check_superseded(self) -> None:
        if self.superseded and self.yielded < len(self._owner):
            raise RuntimeError(
                f"stoke.torch.Loader: this iterator of epoch {self.epoch} was replaced by a later iter() of the same "
                f"loader after {self.yielded} of its {len(self._owner)} batches; a loader runs one epoch at a time "
                "(use two Loaders to iterate twice at once)")

    def _next(self) -> Dict[str, Any]:
        self._check_superseded()
        if self._native is None or self._native is not self._owner._native:
            raise StopIteration  # the loader was closed
        if self.yielded >= len(self._owner):
            # The pipeline is already working on the next epoch: the next iter() picks it up. An
            # older iterator of the same pipeline (a counted loop went on with a new iter()) must
            # not move the position back.
            if self._owner._current() is self:
                self._owner._position = (self.epoch + 1, 0)
            self._native = None
            raise StopIteration
        owner = self._owner
        try:
            if owner._device < 0:
                got = self._native.next()
            else:
                # The loader's GPU current while its stream waits for the copy (stream 0 means the
                # current device's default stream).
                stream = torch.cuda.current_stream(owner._device)
                with torch.cuda.device(owner._device):
                    got = self._native.next(stream.cuda_stream)
        except _stoke.BuffersHeldError:
            raise  # nothing was taken: the same iterator goes on once the held tensors are freed
        except BaseException:
            # A bad record under on_error="fail", Ctrl-C, ...: this pipeline is not reused (this
            # iterator ends, as a generator does after raising); the next iter() starts a new one,
            # where set_epoch or load_state_dict(state_dict()) says.
            self._drop_pipeline()
            raise
        if got is None:
            # Closed from another thread while waiting: by close() (the end), or by a later iter()
            # (another thread's loop took the pipeline over: an error, not a short epoch).
            self._drop_pipeline()
            self._check_superseded()
            raise StopIteration
        images, labels, indices, epoch, number, replaced = got
        self.yielded += 1
        # After the epoch's last batch the pipeline is already on the next epoch: an iter() that
        # comes before this iterator's StopIteration (a loop that counts its batches) goes on with it.
        owner._position = (self.epoch, self.yielded) if self.yielded < len(owner) else (self.epoch + 1, 0)
        if owner._current() is self and self.counts:
            owner._handed = (self.epoch, self.yielded)
        images = torch.utils.dlpack.from_dlpack(images)
        labels = torch.utils.dlpack.from_dlpack(labels)
        if owner._device >= 0:
            # Queued on the consumer's stream after the wait for the copy; dropping the slot's views
            # afterwards returns the slot on that stream, behind this work.
            labels = labels.long()
            if owner._options.normalize:
                images = owner._normalize_on_device(images, stream)
        elif owner._cast is not None:
            images = images.to(owner._cast)
        return {
            "images": images,
            "labels": labels,
            "indices": torch.utils.dlpack.from_dlpack(indices),
            "epoch": epoch,
            "batch": number,
            "replaced": replaced,
        }

    def _drop_pipeline(self) -> None:
        if self._native is not None and self._native is self._owner._native:
            self._owner._close_native()
        self._native = None


class Loader:
    """Batches of a stoke dataset as torch tensors.

    Each iteration yields a dict: ``images`` uint8 ``[B, 3, H, W]`` (channels-last memory: a view
    of the loader's NHWC buffer), ``labels`` int64 ``[B]``, ``indices`` int64 ``[B]`` (the records),
    ``epoch``, ``batch`` (its number within the epoch) and ``replaced`` (samples whose record was
    bad and was replaced, under ``on_error="skip"``, up to ``max_skip_fraction`` of an epoch's
    samples; past that the iteration raises).

    ``iter()`` starts the next epoch (0, 1, ...); ``set_epoch(e)`` chooses it, as with
    ``DistributedSampler``. With several ranks (``rank``/``world_size``, else ``torch.distributed``,
    else the ``RANK``/``WORLD_SIZE`` variables) each rank gets ``batch_size`` samples of every
    global batch of ``batch_size * world_size``: disjoint shards of equal length, the same slices
    as ``stoke train`` under mpirun. ``state_dict()`` records how many batches of the epoch were
    handed out; ``load_state_dict()`` makes the next ``iter()`` resume exactly there.

    ``normalize=(mean, std)`` (in [0, 1] units, per channel) gives ``(x / 255 - mean) / std``
    instead of uint8, as ``dtype`` (torch.float32 by default, float16 or bfloat16), normalised by
    stoke on the loader's side; those tensors own their memory and the ring buffer is returned at
    once.

    ``device="cuda"`` (or ``"cuda:N"``): the ring's pinned buffers are copied to that GPU while the
    CPU decodes the next batches, and batches arrive there: ``images`` a uint8 view of the slot's
    device memory (with ``normalize``, stoke's kernel writes ``dtype`` into a tensor of torch's
    allocator and the slot goes back at once), ``labels`` int64 on the GPU, ``indices`` on the
    host. Everything is ordered on the current CUDA stream of that device when the batch is taken:
    the stream waits for the copy, and a slot freed by its last tensor is refilled only after the
    work queued on that stream. Take a batch under the stream that uses it
    (``with torch.cuda.stream(s)``); ``record_stream`` does not protect these views (torch did not
    allocate them): use another stream only on a ``.clone()``.

    Training (``train=True``): full shuffle, RandomResizedCrop to ``size`` with ``scale`` (default
    ``(0.08, 1.0)``) and a horizontal flip with probability ``flip`` (default 0.5). Evaluation: the
    records in order, the shorter side resized to ``resize`` (default ``size * 256 / 224``), centre
    crop ``size``. An option of the other mode is refused, whatever its value.
    """

    def __init__(
        self,
        path: Union[str, "os.PathLike[str]"],
        batch_size: int,
        *,
        train: bool = True,
        size: int = 224,
        seed: int = 0,
        threads: int = 0,
        ring: int = 4,
        drop_last: bool = False,
        on_error: str = "skip",
        max_skip_fraction: float = 0.01,
        device: Union[str, "torch.device"] = "cpu",
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        scale: Optional[Tuple[float, float]] = None,
        flip: Optional[float] = None,
        resize: Optional[int] = None,
        normalize: Optional[Tuple[Tuple[float, float, float], Tuple[float, float, float]]] = None,
        dtype: Any = None,
    ) -> None:
        # An option of the other mode would be ignored without a word: given at all, it is refused.
        # (None is "not given": scale (0.08, 1.0), flip 0.5, resize size * 256 / 224.)
        other = ({"resize": resize} if train else {"scale": scale, "flip": flip})
        given = {k: v for k, v in other.items() if v is not None}
        if given:
            named = ", ".join(f"{k}={v}" for k, v in given.items())
            raise ValueError(f"stoke.torch.Loader: {named}: {'applies' if len(given) == 1 else 'apply'} to "
                             + ("train=False only (the evaluation resize before the centre crop)" if train else
                                "train=True only (the random crop and flip); evaluation takes a centre crop"))
        scale = (0.08, 1.0) if scale is None else scale
        flip = 0.5 if flip is None else flip
        resize = 0 if resize is None else resize
        checked = _checked_options(batch_size=batch_size, size=size, seed=seed, threads=threads, ring=ring,
                                   resize=resize, train=train, drop_last=drop_last, on_error=on_error, rank=rank,
                                   world_size=world_size, scale=scale, flip=flip, normalize=normalize,
                                   max_skip_fraction=max_skip_fraction)
        batch_size, size, seed, threads, ring, resize = (checked[k] for k in
                                                         ("batch_size", "size", "seed", "threads", "ring", "resize"))
        train, drop_last, rank, world_size = checked["train"], checked["drop_last"], checked["rank"], checked["world_size"]
        scale, flip, normalize = checked["scale"], checked["flip"], checked["normalize"]
        self._device = _device_index(device)
        self._dataset = _stoke.Dataset(path)
        r, w = _rank_and_world(rank, world_size)
        self._sharded_by_caller = rank is not None and world_size is not None
        if not 0 <= r < w:
            raise ValueError(f"stoke.torch.Loader: rank {r} is not in [0, world_size {w})")
        o = _stoke.EpochOptions()
        o.batch_size, o.train, o.size, o.seed = batch_size, train, size, seed
        # threads=0: the usable cores, shared among the processes of this machine (torchrun's
        # LOCAL_WORLD_SIZE, mpirun's OMPI_COMM_WORLD_LOCAL_SIZE), as stoke train's ranks share them.
        o.threads = threads if threads != 0 else _stoke._core_share(_local_processes())
        o.ring, o.drop_last, o.on_error = ring, drop_last, on_error
        o.rank, o.world_size = r, w
        o.scale_min, o.scale_max = scale
        o.flip, o.resize = flip, resize
        o.max_skip_fraction = checked["max_skip_fraction"]
        self._cast = None
        self._dtype = None
        if normalize is not None:
            mean, std = normalize
            o.normalize, o.mean, o.std = True, list(mean), list(std)
            dtype = torch.float32 if dtype is None else dtype
            if dtype not in (torch.float32, torch.float16, torch.bfloat16):
                raise ValueError(f"stoke.torch.Loader: dtype {dtype}: expected torch.float32, float16 or bfloat16")
            self._dtype = dtype
            # On the host stoke normalises to float32 or float16 (bfloat16 is a cast of the float32
            # result); on a GPU its kernel writes any of the three.
            o.dtype = "float16" if dtype == torch.float16 else "float32"
            self._cast = torch.bfloat16 if dtype == torch.bfloat16 and self._device < 0 else None
        elif dtype is not None:
            raise ValueError("stoke.torch.Loader: dtype= needs normalize=(mean, std); without it batches are uint8")
        o.device = self._device
        self._options = o
        self._next_epoch = 0
        self._start_batch = 0
        # The latest epoch iterator, held weakly: it holds the loader (a loop over a temporary
        # Loader must keep it), so a strong reference back would keep a dropped loader's threads and
        # ring alive until the cyclic garbage collector ran. What state_dict() needs of it is kept in
        # _handed: (epoch, batches handed out), None once set_epoch or load_state_dict chose the next
        # start.
        self._current: Callable[[], Optional[_Epoch]] = _no_epoch
        self._handed: Optional[Tuple[int, int]] = None
        # The running pipeline (endless: one epoch flows into the next without draining) and the
        # (epoch, batch) of the next batch it will hand out.
        self._native: Any = None
        # The bad records of this run's pipelines that have ended (and of a loaded state): a new
        # pipeline starts with them, so the skip budget and bad_records() are the run's.
        self._known_bad: Dict[int, Tuple[str, bool]] = {}  # index: (reason, own)
        self._restart = False  # load_state_dict() chose the known bad records: the next iter() starts anew
        self._position: Tuple[int, int] = (-1, -1)
        # Checks every option now (the error names it) and learns the epoch's length.
        with self._on_device():
            probe = _stoke.EpochLoader(self._dataset, o)
        self._len = probe.batches()
        probe.close()

    def _on_device(self) -> Any:
        """The loader's GPU as the current device while its native side sets up (it selects it)."""
        return torch.cuda.device(self._device) if self._device >= 0 else contextlib.nullcontext()

    def _normalize_on_device(self, images: "torch.Tensor", stream: Any) -> "torch.Tensor":
        """stoke's normalisation kernel, from the slot's uint8 view into a tensor of torch's allocator."""
        n, _, h, w = images.shape
        out = torch.empty((n, h, w, 3), dtype=self._dtype, device=images.device)
        name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[self._dtype]
        o = self._options
        with torch.cuda.device(self._device):
            _stoke._normalize_on_device(images.data_ptr(), n, h * w, o.mean, o.std, name, out.data_ptr(),
                                        stream.cuda_stream)
        return out.permute(0, 3, 1, 2)

    @property
    def device(self) -> "torch.device":
        """Where the batches are: the host, or the GPU they are copied to."""
        return torch.device("cpu") if self._device < 0 else torch.device("cuda", self._device)

    @property
    def dataset(self) -> Any:
        return self._dataset

    @property
    def rank(self) -> int:
        return self._options.rank

    @property
    def world_size(self) -> int:
        return self._options.world_size

    @property
    def threads(self) -> int:
        """The decoding threads: ``threads`` as passed, else this process's share of the usable cores."""
        return self._options.threads

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank)."""
        return self._len

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``iter()`` runs (its order and augmentation come from the seed and it),
        from its first batch; after ``load_state_dict``, the epoch of the state keeps the state's batch."""
        if not _is_count(epoch) or epoch >= _MAX_EPOCH:
            raise ValueError(f"stoke.torch.Loader.set_epoch: epoch {epoch!r}: expected an int in [0, 2**62)")
        if self._restart and int(epoch) == self._next_epoch:
            # After load_state_dict, the usual `set_epoch(e)` of a DistributedSampler loop for the
            # epoch the state resumes keeps its batch: starting it over repeated the batches trained on.
            return
        self._next_epoch = int(epoch)
        self._start_batch = 0
        self._handed = None
        self._detach_current()

    def _detach_current(self) -> None:
        """set_epoch or load_state_dict chose where the next iter() starts: batches the running
        iterator still hands out no longer move what state_dict() says."""
        current = self._current()
        if current is not None:
            current.counts = False

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        worker = torch.utils.data.get_worker_info()
        if worker is not None and worker.num_workers > 1 and not self._sharded_by_caller:
            # Each worker would run the whole epoch: every sample num_workers times, silently.
            raise RuntimeError(
                f"stoke.torch.Loader: iterated in DataLoader worker {worker.id} of {worker.num_workers}; a Loader is "
                "the whole input pipeline (its own decoding threads), and each worker would hand out the whole epoch: "
                "iterate the Loader itself, without a DataLoader around it (or pass rank= and world_size= to shard it "
                "among the workers yourself, or rank=0, world_size=1 for a whole epoch in each)")
        wanted = (self._next_epoch, self._start_batch)
        previous = self._current()
        if previous is not None:
            previous.superseded = True  # before its pipeline may be closed below (a next() may wait on it)
        # A superseded iterator still inside next() on another thread would take the next batch of
        # the pipeline (it then went to that thread, and every later epoch was one batch off).
        busy = previous is not None and previous._busy.locked()
        if self._native is None or self._position != wanted or self._restart or busy:
            # A new start (first epoch, set_epoch, a break, a resume, another thread's next()
            # still waiting): stop the old pipeline.
            self._close_native()
            self._restart = False
            o = self._options
            o.epoch, o.start_batch, o.epochs = wanted[0], wanted[1], 0
            o.known_bad = [(i, reason, own) for i, (reason, own) in sorted(self._known_bad.items())]
            with self._on_device():
                self._native = _stoke.EpochLoader(self._dataset, o)
            self._position = wanted
        current = _Epoch(self, self._native, *wanted)
        self._current = weakref.ref(current)
        self._handed = wanted
        self._next_epoch, self._start_batch = wanted[0] + 1, 0
        return current

    def bad_records(self) -> list:
        """(record index, reason) of the bad records this loader met, sorted by index: those of every
        pipeline it ran (a break, ``set_epoch`` or a resume starts a new one, which goes on counting
        them against ``max_skip_fraction``) and those of a state given to ``load_state_dict``. They
        may include records of batches read ahead and not yet handed out."""
        return [(i, reason) for i, reason, _ in self._bad_records()]

    def _bad_records(self) -> list:
        """(record index, reason, own) of bad_records(): own when met at one of this loader's samples
        (counted against its budget), not when met only looking for a stand-in (another rank's)."""
        if self._native is not None and not self._restart:
            return self._native.bad_records()  # it started with the known ones
        return [(i, reason, own) for i, (reason, own) in sorted(self._known_bad.items())]

    def _identity(self) -> Dict[str, Any]:
        """What a state must match: the dataset (by content, not path) and the batches' order."""
        o = self._options
        return {"records": len(self._dataset), "classes": len(self._dataset.classes),
                "payload_bytes": self._dataset.payload_bytes, "fingerprint": self._dataset.fingerprint,
                "batch_size": o.batch_size, "seed": o.seed,
                "world_size": o.world_size, "train": o.train, "drop_last": o.drop_last}

    def state_dict(self) -> Dict[str, Any]:
        """Where the loader is: the epoch and how many of its batches were handed out."""
        epoch, batch = self._handed if self._handed is not None else (self._next_epoch, self._start_batch)
        if batch >= self._len:
            epoch, batch = epoch + 1, 0
        return {"dataset": self._dataset.path, "rank": self._options.rank, **self._identity(),
                "epoch": epoch, "batch": batch,
                "bad_records": [[i, r, own] for i, r, own in self._bad_records()]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """The next ``iter()`` resumes where ``state`` was taken. Refuses a state of another dataset
        (records, classes, bytes, the pack's fingerprint: the same images packed in another order are
        another dataset), batch size, seed, world size, mode or ``drop_last``."""
        def plain(v: Any) -> Any:
            """numpy's ints and bools (a state through np.savez, say) as Python's; anything else as is."""
            if isinstance(v, (bool, np_bool)):
                return bool(v)
            return int(v) if isinstance(v, numbers.Integral) else v

        if not isinstance(state, collections.abc.Mapping):
            raise ValueError(f"stoke.torch.Loader.load_state_dict: expected a loader state (the dict that "
                             f"state_dict() returns), got {type(state).__name__}")
        for key, mine in self._identity().items():
            if key == "fingerprint" and key not in state:
                continue  # a state saved before states carried it
            theirs = plain(state.get(key))
            if key not in state or theirs != mine or type(theirs) is not type(mine):
                raise ValueError(f"stoke.torch.Loader.load_state_dict: the state has {key}={state.get(key)!r} "
                                 f"({type(state.get(key)).__name__}), this loader {key}={mine!r} "
                                 f"({type(mine).__name__}) (a state of another dataset or loader)")
        epoch, batch = state.get("epoch"), state.get("batch")
        if not _is_count(epoch) or epoch >= _MAX_EPOCH:
            raise ValueError(f"stoke.torch.Loader.load_state_dict: epoch {epoch!r}: expected an int in [0, 2**62)")
        if not _is_count(batch) or batch > self._len:
            raise ValueError(f"stoke.torch.Loader.load_state_dict: batch {batch!r}: expected an int from 0 to "
                             f"the {self._len} batches of an epoch")
        bad = state.get("bad_records", [])  # a state saved before states carried them has none
        records = len(self._dataset)

        def utf8(text: Any) -> bool:
            if not isinstance(text, str):
                return False
            try:
                text.encode("utf-8")  # (a lone surrogate, as os.fsdecode makes of odd bytes, is not)
                return True
            except UnicodeEncodeError:
                return False

        # [index, reason, own]; [index, reason] (states of earlier versions) counts as own.
        if not isinstance(bad, (list, tuple)) or not all(
                isinstance(b, (list, tuple)) and len(b) in (2, 3) and _is_count(b[0]) and b[0] < records
                and utf8(b[1]) and (len(b) == 2 or isinstance(b[2], (bool, np_bool))) for b in bad):
            raise ValueError("stoke.torch.Loader.load_state_dict: bad_records: expected a list of [record index, "
                             f"reason, own] with indices below {records}, reasons UTF-8 text and own True or False")
        # Another rank's state (one rank saved the checkpoint every rank loads: the position is the
        # same on every rank) knows which records are bad, not which were this rank's samples: they
        # are all taken as not its own, each counted when met at one of this rank's samples.
        theirs = plain(state.get("rank", self._options.rank))
        same_rank = theirs == self._options.rank and type(theirs) is type(self._options.rank)
        self._known_bad = {int(b[0]): (b[1], same_rank and (len(b) == 2 or bool(b[2]))) for b in bad}
        self._detach_current()
        self._restart = True
        self._next_epoch, self._start_batch = int(epoch), int(batch)
        if self._start_batch == self._len:
            self._next_epoch, self._start_batch = self._next_epoch + 1, 0
        self._handed = None

    def _close_native(self) -> None:
        self._current = _no_epoch
        # Taken first: a next() woken on another thread by this close() calls here too, and must
        # find nothing to close (it read an empty list from the closing pipeline).
        native, self._native = self._native, None
        if native is not None:
            self._position = (-1, -1)
            with self._on_device():
                native.close()
            if not self._restart:  # a loaded state's bad records replace this run's
                for index, reason, own in native.bad_records():  # the native side keeps them once closed
                    known_reason, known_own = self._known_bad.get(index, (reason, False))
                    self._known_bad[index] = (known_reason, known_own or own)

    def close(self) -> None:
        """Stops the pipeline and joins its threads. Tensors already handed out stay valid."""
        self._close_native()

    def __copy__(self) -> "Loader":
        raise TypeError("stoke.torch.Loader cannot be copied: it owns a running pipeline; make another Loader "
                        "with the same arguments")

    def __deepcopy__(self, memo: Any) -> "Loader":
        return self.__copy__()

    def __reduce__(self) -> Any:
        raise TypeError("stoke.torch.Loader cannot be pickled: it owns a running pipeline; make the Loader in the "
                        "process that uses it")

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
