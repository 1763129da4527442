"""stoke: packed image datasets and a fast CPU loader, for your own training loop.

    import stoke
    ds = stoke.Dataset("train.lmdb")        # len(ds), ds.classes, ds.record(i)

    from stoke.torch import Loader           # PyTorch tensors, zero-copy
    for batch in Loader("train.lmdb", batch_size=256):
        images, labels = batch["images"], batch["labels"]

Datasets are made by `stoke pack` (the command line tool).
"""
from ._stoke import Dataset, __version__

__all__ = ["Dataset", "__version__"]
