"""Types of stoke's native module (python/src/module.cc). Use it through `stoke` and `stoke.torch`."""
import os
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

__version__: str

class BuffersHeldError(RuntimeError):
    """Every ring buffer is viewed by tensors the caller holds; .clone() what is kept."""

class RecordBytes:
    """A record's encoded bytes inside the dataset's read-only map (buffer protocol)."""
    def __len__(self) -> int: ...

class Dataset:
    def __init__(self, path: Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]) -> None: ...
    def __len__(self) -> int: ...
    @property
    def path(self) -> str: ...
    @property
    def classes(self) -> List[str]: ...
    @property
    def class_counts(self) -> List[int]: ...
    @property
    def format_version(self) -> int: ...
    @property
    def payload_bytes(self) -> int: ...
    @property
    def fingerprint(self) -> str:
        """stoke pack's fingerprint of the inputs and options ('' if none)."""
    def record(self, index: int) -> Dict[str, Any]:
        """index, label, width, height, source, bytes (a read-only memoryview)."""
    def verify(self, threads: int = 0) -> List[Tuple[int, str, str]]: ...

class EpochOptions:
    batch_size: int
    train: bool
    size: int
    resize: int
    scale_min: float
    scale_max: float
    flip: float
    seed: int
    threads: int
    ring: int
    drop_last: bool
    on_error: str
    max_skip_fraction: float
    known_bad: List[Tuple[int, str, bool]]  # index, reason, own (met at one of this loader's samples)
    rank: int
    world_size: int
    epoch: int
    start_batch: int
    epochs: int
    normalize: bool
    mean: List[float]
    std: List[float]
    dtype: str
    device: int  # -1: host memory; N: batches copied to GPU N
    def __init__(self) -> None: ...

class EpochLoader:
    def __init__(self, dataset: Dataset, options: EpochOptions) -> None: ...
    def batches(self) -> int:
        """Batches in this epoch for this rank (from the first, not the start)."""
    def next(self, stream: int = 0) -> Optional[Tuple[Any, Any, Any, int, int, int]]:
        """(images, labels, indices, epoch, number, replaced) as DLPack capsules and ints, or None
        at the end of the epoch. Waits with the GIL released; Ctrl-C raises KeyboardInterrupt. On a
        GPU, `stream` (a cudaStream_t) waits for the copy and the slot returns on it; images (uint8)
        and labels (int32) are then device views of the slot."""
    def close(self) -> None: ...
    def stats(self) -> Dict[str, Any]: ...
    def bad_records(self) -> List[Tuple[int, str, bool]]: ...  # index, reason, own

def _pack(source: Union[str, bytes], output: Union[str, bytes], options: Dict[str, Any], progress: Optional[Callable[[int], Any]]) -> Dict[str, Any]: ...
def _verify(path: str, threads: int) -> List[Tuple[int, str, str]]: ...
def _normalize_on_device(images: int, count: int, pixels: int, mean: List[float], std: List[float], dtype: str,
                         out: int, stream: int) -> None: ...
def _core_share(processes: int) -> int:
    """One process's share of the usable cores when `processes` of a job share this machine."""
def _cuda() -> Tuple[bool, int, str]:
    """(built with CUDA, usable GPUs, why none)."""
def _reference_batches(dataset: Dataset, options: EpochOptions, max_batches: int) -> List[Tuple[bytes, List[int], List[int]]]: ...
