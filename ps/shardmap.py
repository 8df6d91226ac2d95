"""Which shard owns which bytes of the model: a deterministic partition of the parameters.

The parameters are viewed as one flat float32 vector (leaves in `jax.tree` order, each
raveled). Leaves are cut into pieces of at most `chunk_elems` elements (a large leaf is split
into near-equal parts, so one big matrix cannot unbalance the shards), then pieces are dealt
largest-first to the shard holding the fewest bytes so far (ties: lowest shard index).
Everything here depends only on the parameter shapes and K, never on Python's `hash()`, so
servers and workers started separately (a scheduler, another host) compute the same map and
can check it by its fingerprint.

Splitting a leaf across shards is exact for elementwise optimizers (adamw, sgd+momentum,
adamw's weight decay too): each element's update depends only on that element's history.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import dataclass

import numpy as np

from jaxdist.errors import UsageError

# 4 KiB minimum piece: smaller pieces add per-frame overhead without improving balance.
MIN_CHUNK_ELEMS = 1024
# 4 MiB maximum piece (BytePS's choice); a piece travels in 1 MiB frames anyway.
MAX_CHUNK_ELEMS = 1 << 20
# Aim for this many pieces per shard so greedy dealing balances within one piece.
PIECES_PER_SHARD = 8


@dataclass(frozen=True)
class Leaf:
    name: str        # "hidden/0/kernel"
    shape: tuple
    dtype: str
    offset: int      # first element in the global flat vector
    size: int


@dataclass(frozen=True)
class Piece:
    name: str          # "hidden/0/kernel[0:1024]": what travels in a frame header
    leaf: str
    start: int         # within the leaf's flat view
    length: int        # elements
    offset: int        # within the global flat vector
    shard: int
    shard_offset: int  # within the shard's own flat vector


@dataclass(frozen=True)
class ShardMap:
    num_shards: int
    chunk_elems: int
    leaves: tuple      # of Leaf, in tree order
    pieces: tuple      # of Piece, grouped by shard, each group in global-offset order
    total: int         # elements

    @property
    def itemsize(self) -> int:
        return 4

    def shard_pieces(self, shard: int) -> list[Piece]:
        return [p for p in self.pieces if p.shard == shard]

    def shard_size(self, shard: int) -> int:
        return sum(p.length for p in self.pieces if p.shard == shard)

    @property
    def bytes_per_shard(self) -> list[int]:
        return [self.shard_size(k) * self.itemsize for k in range(self.num_shards)]

    def to_dict(self) -> dict:
        return {
            "num_shards": self.num_shards,
            "chunk_elems": self.chunk_elems,
            "total_elems": self.total,
            "fingerprint": self.fingerprint,
            "bytes_per_shard": self.bytes_per_shard,
            "leaves": [{"name": l.name, "shape": list(l.shape), "dtype": l.dtype,
                        "offset": l.offset, "size": l.size} for l in self.leaves],
            "pieces": [{"name": p.name, "shard": p.shard, "offset": p.offset,
                        "length": p.length, "shard_offset": p.shard_offset}
                       for p in self.pieces],
        }

    @property
    def fingerprint(self) -> str:
        """sha256 of the canonical map: equal on every process that computed the same map."""
        canon = json.dumps({
            "k": self.num_shards, "chunk": self.chunk_elems,
            "leaves": [[l.name, list(l.shape), l.dtype] for l in self.leaves],
            "pieces": [[p.name, p.shard] for p in self.pieces]}, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:16]

    def gather(self, flat: np.ndarray, shard: int) -> np.ndarray:
        """The shard's own vector out of a global flat vector."""
        return np.concatenate([flat[p.offset:p.offset + p.length]
                               for p in self.shard_pieces(shard)])

    def describe(self) -> str:
        sizes = ", ".join(f"{b / 1024:.1f} KiB" for b in self.bytes_per_shard)
        return (f"shard map {self.fingerprint}: {self.total:,} parameters in "
                f"{len(self.pieces)} pieces of <= {self.chunk_elems:,} elements over "
                f"{self.num_shards} shards ({sizes})")


def leaf_name(path) -> str:
    parts = []
    for key in path:
        name = getattr(key, "key", None)
        if name is None:
            name = getattr(key, "idx", None)
        if name is None:
            name = getattr(key, "name", None)
        if name == "value":  # nnx.Variable's own attribute, not part of the model's path
            continue
        parts.append(str(name))
    return "/".join(parts)


def leaves_of(abstract_params) -> list[Leaf]:
    import jax

    out, offset = [], 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        size = math.prod(leaf.shape)
        dtype = np.dtype(leaf.dtype).name
        if dtype != "float32":
            raise UsageError(f"--layout ps keeps float32 parameters on the servers; "
                             f"{leaf_name(path)} is {dtype}")
        out.append(Leaf(leaf_name(path), tuple(leaf.shape), dtype, offset, size))
        offset += size
    return out


def default_chunk_elems(total: int, num_shards: int) -> int:
    target = math.ceil(total / (num_shards * PIECES_PER_SHARD))
    return int(min(MAX_CHUNK_ELEMS, max(MIN_CHUNK_ELEMS, target)))


def build_shard_map(leaves: list[Leaf], num_shards: int,
                    chunk_elems: int | None = None) -> ShardMap:
    if num_shards < 1:
        raise UsageError(f"--ps-shards must be 1 or more, got {num_shards}")
    total = sum(l.size for l in leaves)
    chunk = chunk_elems or default_chunk_elems(total, num_shards)
    raw = []  # (leaf, start, length, global offset)
    for leaf in leaves:
        parts = max(1, math.ceil(leaf.size / chunk))
        bounds = np.linspace(0, leaf.size, parts + 1).round().astype(np.int64)
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                raw.append((leaf, int(a), int(b - a), leaf.offset + int(a)))
    if num_shards > len(raw):
        raise UsageError(f"--ps-shards {num_shards} exceeds the {len(raw)} pieces the model's "
                         f"{total:,} parameters split into; use at most {len(raw)} shards")
    load = [0] * num_shards
    owner = {}
    for leaf, start, length, offset in sorted(raw, key=lambda r: (-r[2], r[3])):
        k = min(range(num_shards), key=lambda s: (load[s], s))
        owner[offset] = k
        load[k] += length
    pieces = []
    for k in range(num_shards):
        pos = 0
        for leaf, start, length, offset in raw:  # raw is in global-offset order
            if owner[offset] == k:
                pieces.append(Piece(f"{leaf.name}[{start}:{start + length}]", leaf.name,
                                    start, length, offset, k, pos))
                pos += length
    return ShardMap(num_shards, chunk, tuple(leaves), tuple(pieces), total)


def abstract_model(job):
    """(model config, graphdef, abstract params, abstract model state) of a job
    (jaxdist.job): shapes only, no backend starts (the launcher must not take a device)."""
    return _abstract_model(job.model, job.dtype, job.train.seed)


@functools.lru_cache(maxsize=4)
def _abstract_model(model_cfg, dtype: str, seed: int):
    from flax import nnx

    from jaxdist.train_step import DTYPES, split_model

    graphdef, params, model_state = nnx.eval_shape(
        lambda: split_model(model_cfg, DTYPES[dtype], seed))
    return model_cfg, graphdef, params, model_state


def shard_map_for(job, num_shards: int | None = None) -> ShardMap:
    """The map for a job (jaxdist.job), from abstract shapes only."""
    params = abstract_model(job)[2]
    return build_shard_map(leaves_of(params), num_shards or job.ps.ps_shards)
