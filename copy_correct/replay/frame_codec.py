"""The codecs of ``FrameReplayBuffer(compress=...)``, each frame compressed alone (so any one decompresses without
its neighbours): ``"zstd"`` (the ``zstandard`` package, level 1, frames without magic number, content size, checksum
or dictionary id: 4 to 9 bytes less each) and ``"lz4"`` (the ``lz4`` package's block format, without a stored size).
Chosen by measurement on Atari frames (docs/benchmarks.md): zstd the smallest at about 6-11 µs a frame, lz4 half
zstd's time and half again its bytes; blosc2's codecs and filters were larger or slower on 84x84 grey frames. Both
packages are the ``compress`` extra; a name not here, or a codec whose package is missing, is refused in one line.

Copy contract: ``compress`` returns new bytes, ``decompress`` new bytes of the frame; neither keeps a reference to
what it is given nor touches it, and neither sees a tensor (the buffer hands them numpy memory).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["CODECS", "EXTRA", "Codec", "codec"]

EXTRA = 'pip install "copy-correct[compress]"'
CODECS = {"zstd": "zstandard", "lz4": "lz4"}  # codec: the package that provides it


@dataclass(frozen=True)
class Codec:
    """A codec's calls for frames of ``frame_bytes`` bytes; ``bound``: the most bytes one compressed frame takes."""

    name: str
    compress: Callable[[Any], bytes]
    decompress: Callable[[Any], bytes]
    bound: int


def codec(name: str, frame_bytes: int) -> Codec:
    """The codec called ``name``, for frames of ``frame_bytes`` bytes."""
    if name not in CODECS:
        raise ValueError(f"compress must be None or one of {', '.join(map(repr, CODECS))}, got {name!r}")
    try:
        module = importlib.import_module(CODECS[name] if name == "zstd" else "lz4.block")
    except ImportError:
        raise ImportError(f"compress={name!r} needs the {CODECS[name]} package: {EXTRA}") from None
    # Over both libraries' bounds: ZSTD_COMPRESSBOUND (n + n/256 + (128 KiB - n)/2048 under 128 KiB, so at most 64
    # more) and LZ4_COMPRESSBOUND (n + n/255 + 16).
    bound = frame_bytes + frame_bytes // 128 + 80
    if name == "lz4":
        return Codec(
            name,
            lambda frame: module.compress(frame, store_size=False),
            lambda data: module.decompress(data, uncompressed_size=frame_bytes),
            bound,
        )
    magicless = module.FORMAT_ZSTD1_MAGICLESS
    params = module.ZstdCompressionParameters.from_level(
        1, source_size=frame_bytes, format=magicless, write_content_size=False, write_checksum=False,
        write_dict_id=False,
    )  # fmt: skip
    compressor = module.ZstdCompressor(compression_params=params)
    decompressor = module.ZstdDecompressor(format=magicless)
    return Codec(
        name,
        compressor.compress,
        lambda data: decompressor.decompress(data, max_output_size=frame_bytes),
        bound,
    )
