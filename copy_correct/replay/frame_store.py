"""The compressed frames of a ``FrameReplayBuffer(compress=...)``: each frame compressed once, into blocks of
``BLOCK`` bytes (or the codec's bound, if larger) that the env streams take from one pool. A stream fills its block in
order and takes another when a frame does not fit; as a stream's ring overwrites its oldest frames in order, a block
whose last frame is overwritten goes back to the pool (at most two partly used blocks a stream). Per slot of each
ring: where its bytes are (``block * block size + offset``, uint32 until the pool outgrows 4 GiB, then int64) and how
many (uint16 when the codec's bound fits). No Python object per frame, one per block.

When: a frame is compressed at the next read (``gather``, ``state``), or by the put that leaves ``PENDING`` frames
waiting, in the order the frames were put, so the blocks are what compressing each at its put would give. In
CleanRL's cadence (a sample every 4 steps) the compression is the sample's: the add is as cheap as an uncompressed
one, and with ``SampleAhead`` the compression runs on its thread, beside the network's update.

Copy contract: new storage only: a block, once, when the pool has none free (``nbytes`` counts every block, the
per-slot arrays and the frames waiting); ``put`` copies a frame once, into bytes, kept as ``newest`` (each stream's
newest frame, which ``add``'s checks compare with) and until compressed into a block; ``gather`` decompresses each
distinct frame once into new memory, then copies the rows asked for into the caller's tensor. ``state`` copies the
live compressed bytes, oldest first, into new memory; ``load`` copies them into fresh blocks. Numpy memory and bytes
only: autograd sees none of it.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
import torch

from copy_correct.replay.frame_codec import Codec

__all__ = ["BLOCK", "CompressedFrames"]

NONE = np.empty(0, dtype=np.int64)

BLOCK = 1 << 16
PENDING = 64  # frames put and not yet compressed, at most: the next read, or the put that makes this many, compresses
ADDRESSABLE = 1 << 32  # bytes of blocks a uint32 address reaches


class CompressedFrames:
    """``envs`` rings of ``length`` compressed frames of ``shape`` and ``dtype``; a position is a frame's number in
    its stream, written in order (slot ``position % length``)."""

    def __init__(self, codec: Codec, envs: int, length: int, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.codec, self.length, self.shape, self.dtype = codec, length, shape, np.dtype(dtype)
        self.frame_bytes = int(np.prod(shape)) * self.dtype.itemsize
        self.block = max(BLOCK, codec.bound)
        self.address = np.zeros(envs * length, dtype=np.uint32)
        self.size = np.zeros(envs * length, dtype=np.uint16 if codec.bound < 1 << 16 else np.uint32)
        self._flushing = threading.Lock()  # a draw on SampleAhead's thread and a state_dict on the loop's
        self._empty(envs)

    def _empty(self, envs: int) -> None:
        self._blocks: list[memoryview] = []
        self._last_position: list[int] = []  # of each block, the position of the last frame written into it
        self._free: list[int] = []
        self._forget()
        self._open, self._fill = [0] * envs, [self.block] * envs  # each stream's block, and its bytes used
        self.newest = [bytes(self.frame_bytes)] * envs  # each stream's newest frame, as bytes (zeros: none yet)
        self._pending: list[tuple[int, int, bytes]] = []  # (env, position, frame) put since the last flush, in order

    def _forget(self) -> None:
        """Drop the frames the last ``gather`` decompressed (a ``put`` may have overwritten them)."""
        self._decoded_rows, self._decoded = NONE, None

    @property
    def nbytes(self) -> int:
        """Every block, the per-slot arrays, each stream's newest frame and the frames not yet compressed."""
        waiting = sum(data is not self.newest[env] for env, _, data in self._pending)  # the newest: counted once
        held = (len(self.newest) + waiting) * self.frame_bytes
        return len(self._blocks) * self.block + self.address.nbytes + self.size.nbytes + held

    def newest_frames(self, at: np.ndarray) -> np.ndarray:
        """The newest frame of each stream of ``at``, as a new array."""
        joined = b"".join([self.newest[env] for env in at.tolist()])
        return np.frombuffer(joined, dtype=self.dtype).reshape(len(at), *self.shape)

    def put(self, env: int, position: int, frame: np.ndarray) -> None:
        """``frame``, the ``position``-th of stream ``env``, copied once, into bytes: the stream's ``newest``
        (compared as bytes: a third of the time of ``np.array_equal`` right after a network's forward, when the caches
        are cold), and compressed by the next ``flush``: the next read's, or this put's if it makes ``PENDING``."""
        data = frame.tobytes()
        self._pending.append((env, position, data))
        self.newest[env] = data
        self._decoded_rows = NONE
        if len(self._pending) >= PENDING:
            self.flush()

    def flush(self) -> None:
        """Compress the frames put since the last flush into their streams' blocks, in the order they were put: the
        blocks, addresses and sizes are what compressing each at its ``put`` gives."""
        with self._flushing:
            pending, self._pending = self._pending, []
            for env, position, data in pending:
                self._commit(env, position, data)

    def _commit(self, env: int, position: int, data: bytes) -> None:
        if position >= self.length:  # it overwrites the frame `length` before: its block may hold nothing else now
            old = int(self.address[env * self.length + position % self.length]) // self.block
            if self._last_position[old] == position - self.length:
                self._free.append(old)
        self._place(env, position, self.codec.compress(data))

    def _place(self, env: int, position: int, data: bytes) -> None:
        """``data`` into the stream's block (another, from the pool, if it does not fit), for ``position``'s slot."""
        row = env * self.length + position % self.length
        n, block, fill = len(data), self._open[env], self._fill[env]
        if fill + n > self.block:
            block, fill = self._free.pop() if self._free else self._new_block(), 0
            self._open[env] = block
        self._blocks[block][fill : fill + n] = data
        self.address[row] = block * self.block + fill
        self.size[row] = n
        self._fill[env] = fill + n
        self._last_position[block] = position

    def _new_block(self) -> int:
        if (len(self._blocks) + 1) * self.block > ADDRESSABLE and self.address.dtype != np.int64:
            self.address = self.address.astype(np.int64)
        self._blocks.append(memoryview(np.empty(self.block, dtype=np.uint8)))
        self._last_position.append(-1)
        return len(self._blocks) - 1

    def gather(self, rows: np.ndarray, out: torch.Tensor) -> None:
        """Into ``out`` (``len(rows)`` frames): for each row ``env * (length + 1) + slot`` that slot's frame, zeros for
        slot ``length`` (zero padding). Each distinct frame is decompressed once, and not again by the next
        ``gather`` before a ``put`` (``sample``'s second, for ``next_obs``, shares most of the first's frames). The
        frames put since the last read are compressed first (``flush``)."""
        if self._pending:
            self.flush()
        distinct, inverse = np.unique(rows, return_inverse=True)
        frames = np.empty((len(distinct), self.frame_bytes), dtype=np.uint8)
        known = self._decoded_rows
        if len(known):
            at = np.searchsorted(known, distinct).clip(max=len(known) - 1)
            hit = known[at] == distinct
            frames[hit] = self._decoded[at[hit]]
        else:
            hit = np.zeros(len(distinct), dtype=np.bool_)
        envs, slots = np.divmod(distinct, self.length + 1)
        frames[slots == self.length] = 0
        todo = np.flatnonzero(~hit & (slots < self.length))
        if len(todo):
            at = envs[todo] * self.length + slots[todo]
            which, start = np.divmod(self.address[at].astype(np.int64), self.block)
            decompress, blocks = self.codec.decompress, self._blocks
            pieces = [
                decompress(blocks[b][first:end])
                for b, first, end in zip(which.tolist(), start.tolist(), (start + self.size[at]).tolist(), strict=True)
            ]
            frames[todo] = np.frombuffer(b"".join(pieces), dtype=np.uint8).reshape(len(todo), self.frame_bytes)
        self._decoded_rows, self._decoded = distinct, frames
        decoded = torch.from_numpy(frames.view(self.dtype).reshape(len(distinct), *self.shape))
        torch.index_select(decoded, 0, torch.from_numpy(inverse.reshape(-1)), out=out)

    def _live(self, written: np.ndarray) -> list[tuple[int, int, int]]:
        """``(env, position, row)`` of every frame in the rings, stream by stream, oldest first."""
        return [
            (env, position, env * self.length + position % self.length)
            for env, count in enumerate(written.tolist())
            for position in range(max(0, count - self.length), count)
        ]

    def state(self, written: np.ndarray) -> dict[str, np.ndarray]:
        """The live compressed frames of every stream, oldest first, as one new array of bytes, and each slot's size
        (int32: a dtype every torch saves); the frames put since the last read compressed first."""
        if self._pending:
            self.flush()
        rows = [row for _, _, row in self._live(written)]
        data = np.empty(int(self.size[rows].sum()), dtype=np.uint8)
        into, cursor = memoryview(data), 0
        for address, n in zip(self.address[rows].tolist(), self.size[rows].tolist(), strict=True):
            start = address % self.block
            into[cursor : cursor + n] = self._blocks[address // self.block][start : start + n]
            cursor += n
        return {"frame_bytes": data, "frame_size": self.size.astype(np.int32)}

    def check(self, state: Mapping[str, np.ndarray], written: np.ndarray) -> None:
        """``state``'s bytes must be as many as its sizes of the frames in its rings say (one line, nothing loaded)."""
        rows = [row for _, _, row in self._live(written)]
        counted, held = int(state["frame_size"][rows].sum()), len(state["frame_bytes"])
        if counted != held:
            raise ValueError(f"saved frame_bytes holds {held} bytes, its frame_size counts {counted} in its rings")

    def load(self, state: Mapping[str, np.ndarray], written: np.ndarray) -> None:
        """Fresh blocks holding ``state``'s frames (``check``ed), each stream's newest decompressed into ``newest``."""
        data, sizes = memoryview(np.ascontiguousarray(state["frame_bytes"])), state["frame_size"]
        self._empty(len(written))
        self.address = np.zeros_like(self.address, dtype=np.uint32)
        self.size[:] = 0
        cursor = 0
        for env, position, row in self._live(written):
            n = int(sizes[row])
            self._place(env, position, data[cursor : cursor + n])
            cursor += n
            if position == written[env] - 1:
                self.newest[env] = self.codec.decompress(data[cursor - n : cursor])
