"""Reading the datasets EDL's examples train on: idx files (MNIST, Fashion-MNIST), plain or
gzipped, standardized as the Rust workers do (each set by its own pixel mean and deviation),
so a Python worker and a Rust worker see the same numbers for the same sample index."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np

#: Where Debian's `dataset-fashion-mnist` puts the data.
FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


def _read(path: Path) -> bytes:
    for p in (path, path.with_name(path.name + ".gz")):
        if p.exists():
            raw = p.read_bytes()
            return gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    raise FileNotFoundError(
        f"{path}[.gz] not found (Debian: apt-get install dataset-fashion-mnist)"
    )


def _idx(raw: bytes, dims: int, what: Path) -> np.ndarray:
    if len(raw) < 4 + 4 * dims or raw[2] != 0x08 or raw[3] != dims:
        raise ValueError(f"{what} is not an idx file of unsigned bytes with {dims} dimensions")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims))
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims)
    if body.size != int(np.prod(shape)):
        raise ValueError(f"{what}: header says {shape}, the file holds {body.size} bytes")
    return body.reshape(shape)


def load_idx_bytes(prefix) -> tuple[np.ndarray, np.ndarray]:
    """Images as they are stored (n x height x width, uint8, writable) and labels (n, int64)
    from `PREFIX-images-idx3-ubyte[.gz]` and `PREFIX-labels-idx1-ubyte[.gz]`: for a dataset
    that transforms each sample as it loads it."""
    prefix = Path(prefix)
    images_path = prefix.with_name(prefix.name + "-images-idx3-ubyte")
    labels_path = prefix.with_name(prefix.name + "-labels-idx1-ubyte")
    pixels = _idx(_read(images_path), 3, images_path)
    labels = _idx(_read(labels_path), 1, labels_path)
    if len(pixels) != len(labels):
        raise ValueError(f"{len(pixels)} images but {len(labels)} labels under {prefix}")
    # A copy: the file's bytes are read-only, which torch.from_numpy warns about.
    return pixels.copy(), labels.astype(np.int64)


def load_idx(prefix) -> tuple[np.ndarray, np.ndarray]:
    """Images (n x pixels, float32, standardized) and labels (n, int64) from
    `PREFIX-images-idx3-ubyte[.gz]` and `PREFIX-labels-idx1-ubyte[.gz]`."""
    pixels, labels = load_idx_bytes(prefix)
    # The set's own pixel statistics from a histogram of the 256 values (no float64 copy of
    # the set), then float32 arithmetic, as data.rs does.
    counts = np.bincount(pixels.ravel(), minlength=256).astype(np.float64)
    v = np.arange(256, dtype=np.float64) / 255.0
    n = max(counts.sum(), 1.0)
    mean = (counts * v).sum() / n
    std = np.sqrt(max((counts * v * v).sum() / n - mean * mean, 0.0))
    std = std if std > 1e-6 else 1.0
    x = pixels.reshape(len(pixels), -1).astype(np.float32)
    x /= np.float32(255.0)
    x -= np.float32(mean)
    x /= np.float32(std)
    return x, labels


def fashion_mnist_dir(root=None) -> Path:
    """Where Fashion-MNIST is: `root`, else $EDL_DATA_DIR, else Debian's location."""
    return Path(root or os.environ.get("EDL_DATA_DIR") or FASHION_MNIST)


def fashion_mnist(split: str = "train", root=None) -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST's `train` (60,000) or `t10k` (10,000) split, standardized; `root`
    defaults to $EDL_DATA_DIR or Debian's location."""
    return load_idx(fashion_mnist_dir(root) / split)
