"""Attention equivalence: a pack trains exactly like its sequences one by one.

For a pack, q, k and v are built from its tokens (`ProbeEmbedding`), varlen attention runs over
the whole pack with the boundaries a trainer passes (`cu_seqlens_padded`) and the positions it
passes (`position_ids`), and the output rows of every sequence are compared with that sequence's
own causal attention, computed on it alone at positions 0..len-1:

    pack        a0 a1 a2 .  b0 b1 b2 b3         packed varlen attention, cu_seqlens_padded [0, 4, 8]
                 |  |  |     |  |  |  |
    reference   attn(a0 a1 a2)  attn(b0 b1 b2 b3)   each at positions 0.., nothing else in view

Pass rule (the one flash-attn's own tests use): for each pack and dtype, with `ref` the fp32
attention of the dtype-rounded inputs,

    max |packed - ref|  <=  2 * max |unpacked(dtype) - ref|  +  atol(dtype)

where `unpacked(dtype)` is the same formula on each sequence alone, computed entirely in that
dtype: the packed kernel may be as inexact as a plain implementation, twice over, but no more.
Cross-sequence attention, a shifted boundary or positions that do not restart at 0 move the packed
rows by orders of magnitude more.

The contamination probe changes the tokens of one sequence and requires the output rows of every
other sequence to stay bitwise identical (on CPU; within atol on CUDA).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from packctl.arrays import offsets_of, positions_in_segments, ranges
from packctl.contract.thd import PackRows
from packctl.verify.backends import Backend, as_tensor, torch_dtype
from packctl.verify.conservation import splitmix64
from packctl.verify.structure import Violation

ATOL = {"fp32": 1e-5, "bf16": 1e-5, "fp16": 1e-5}
_TOKEN_SALT, _POSITION_SALT = 0x51ED270B27, 0x3C6EF372FE
_PERTURB = 0x2545F491  # XOR-ed into the token ids of the probed sequence (< 2^31, so ids stay int32)


@dataclass
class Pack:
    """One pack's columns as a trainer receives them, and where it came from.

        input_ids [a0 a1 a2 0 b0 b1 b2 b3]  position_ids [0 1 2 3 0 1 2 3]
        seq_lens [3, 4]  seq_lens_padded [4, 4]  cu_seqlens_padded [0, 4, 8]  sample_ids [7, 3]
    """

    input_ids: np.ndarray
    position_ids: np.ndarray
    seq_lens: np.ndarray
    seq_lens_padded: np.ndarray
    cu_seqlens_padded: np.ndarray
    sample_ids: np.ndarray
    shard: str | None = None
    row: int | None = None
    parent_segments: np.ndarray | None = None  # --share-prefix: the pack is a tree (`check_tree_attention`)

    @classmethod
    def from_rows(cls, rows: PackRows, r: int, shard: str | None = None) -> "Pack":
        t0, t1 = int(rows.token_offsets[r]), int(rows.token_offsets[r + 1])
        s0, s1 = int(rows.seq_offsets[r]), int(rows.seq_offsets[r + 1])
        c0, c1 = int(rows.cu_offsets[r]), int(rows.cu_offsets[r + 1])
        parents = None if rows.parent_segments is None else np.array(rows.parent_segments[s0:s1], dtype=np.int64)
        return cls(input_ids=np.array(rows.input_ids[t0:t1]), position_ids=np.array(rows.position_ids[t0:t1]),
                   seq_lens=np.array(rows.seq_lens[s0:s1], dtype=np.int64),
                   seq_lens_padded=np.array(rows.seq_lens_padded[s0:s1], dtype=np.int64),
                   cu_seqlens_padded=np.array(rows.cu_seqlens_padded[c0:c1], dtype=np.int64),
                   sample_ids=np.array(rows.sample_ids[s0:s1], dtype=np.int64), shard=shard, row=r,
                   parent_segments=parents)

    @property
    def offsets(self) -> np.ndarray:
        """Where each sequence truly starts: [0, cumsum(seq_lens_padded)] (not cu_seqlens_padded, which
        is what the kernel is given and what is being tested)."""
        return offsets_of(self.seq_lens_padded)

    def unusable(self) -> str | None:
        """Why a varlen kernel cannot even be run on these columns, or None."""
        total = len(self.input_ids)
        cu = self.cu_seqlens_padded
        if len(self.position_ids) != total:
            return f"position_ids has {len(self.position_ids)} entries for {total} tokens"
        if len(self.seq_lens) == 0 or len(self.seq_lens_padded) != len(self.seq_lens):
            return "seq_lens and seq_lens_padded are empty or of different lengths"
        if (self.seq_lens < 1).any() or (self.seq_lens > self.seq_lens_padded).any():
            return "a sequence is empty or longer than its padded length"
        if int(self.seq_lens_padded.sum()) != total:
            return f"seq_lens_padded sum to {int(self.seq_lens_padded.sum())}, the pack holds {total} tokens"
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != total or (np.diff(cu) < 0).any():
            return f"cu_seqlens_padded {cu.tolist()[:8]}... is not an increasing [0, ..., {total}]"
        if (self.position_ids < 0).any():
            return "position_ids holds negative positions"
        return None

    def where(self, seq: int | None = None) -> dict[str, Any]:
        return {"shard": self.shard, "row": self.row, "sequence": seq}


class ProbeEmbedding:
    """Deterministic q, k, v (T, H, D, fp32) for tokens at positions: a seeded random embedding of
    the token id plus a seeded random embedding of the absolute position, then rotary embedding by
    position on q and k.

    Rotary alone makes q.k depend only on the distance between positions, so a sequence whose
    position_ids counted on from the previous sequence would attend exactly as if they restarted;
    the absolute term makes every position count. Values are splitmix64 hashes of (seed, id or
    position, feature) turned into floats exactly, so the same token at the same position gets
    bitwise the same q, k, v wherever it is computed.
    """

    def __init__(self, *, seed: int = 0, heads: int = 2, head_dim: int = 64, base: float = 10000.0):
        if head_dim % 2 or head_dim < 2:
            raise ValueError("head_dim must be even")
        self.seed, self.heads, self.head_dim = seed, heads, head_dim
        self.width = 3 * heads * head_dim
        self.inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)

    def _features(self, values: np.ndarray, salt: int) -> np.ndarray:
        """(len(values), width) float32 with mean 0, variance 1, one row per distinct value, gathered."""
        unique, inverse = np.unique(np.asarray(values, dtype=np.int64), return_inverse=True)
        key = splitmix64(np.array([self.seed ^ salt], dtype=np.uint64))
        row = splitmix64(unique.view(np.uint64) ^ key)
        feature = splitmix64(np.arange(self.width, dtype=np.uint64))
        bits = splitmix64(row[:, None] ^ feature[None, :])
        uniform = (bits >> np.uint64(40)).astype(np.float32) / np.float32(1 << 24) - np.float32(0.5)
        return (uniform * np.float32(math.sqrt(12.0)))[inverse.ravel()]

    def qkv(self, input_ids: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """(3, T, H, D) float32: q, k, v of each token."""
        x = (self._features(input_ids, _TOKEN_SALT) + self._features(position_ids, _POSITION_SALT)) * np.float32(
            1 / math.sqrt(2.0))
        x = x.reshape(len(input_ids), 3, self.heads, self.head_dim).transpose(1, 0, 2, 3)
        unique, inverse = np.unique(np.asarray(position_ids, dtype=np.int64), return_inverse=True)
        angle = unique[:, None].astype(np.float64) * self.inv_freq[None, :]
        cos = np.cos(angle).astype(np.float32)[inverse.ravel()][:, None, :]
        sin = np.sin(angle).astype(np.float32)[inverse.ravel()][:, None, :]
        half = self.head_dim // 2
        for i in (0, 1):  # rotary on q and k, not v
            x1, x2 = x[i, ..., :half].copy(), x[i, ..., half:].copy()
            x[i, ..., :half] = x1 * cos - x2 * sin
            x[i, ..., half:] = x1 * sin + x2 * cos
        return np.ascontiguousarray(x)


def causal_attention(torch, q, k, v, *, upcast: bool = True):
    """softmax(q k^T / sqrt(D) + causal mask) v of one sequence, (L, H, D), written out plainly (no
    fused kernel), in blocks of query rows to bound memory.

    upcast=True computes in fp32: the reference. upcast=False computes every step (scores,
    softmax, output) in the inputs' dtype: the ordinary same-dtype implementation whose error the
    pass rule allows twice over (flash-attn's tests call it `attention_ref(upcast=False)`).
    """
    length, heads, dim = q.shape
    qh, kh, vh = ((t.float() if upcast else t).transpose(0, 1) for t in (q, k, v))
    out = torch.empty_like(qh)
    block = max(64, (1 << 24) // max(length * heads, 1))
    pos = torch.arange(length, device=q.device)
    for lo in range(0, length, block):
        hi = min(length, lo + block)
        scores = torch.matmul(qh[:, lo:hi], kh[:, :hi].transpose(1, 2)) / math.sqrt(dim)
        scores = scores.masked_fill(pos[lo:hi, None] < pos[None, :hi], float("-inf"))
        out[:, lo:hi] = torch.matmul(torch.softmax(scores, dim=-1), vh[:, :hi])
    return out.transpose(0, 1)


@dataclass
class PackInputs:
    """q, k, v of one pack (as packed) and of its sequences (alone, positions 0..len-1), on a device."""

    packed: Any  # (3, T, H, D) fp32 tensor
    alone: Any  # (3, sum(seq_lens), H, D) fp32 tensor
    alone_offsets: np.ndarray
    cu_seqlens_padded: Any  # int32 tensor
    max_seqlen: int

    @classmethod
    def build(cls, torch, pack: Pack, embedding: ProbeEmbedding, device: str,
              input_ids: np.ndarray | None = None) -> "PackInputs":
        ids = pack.input_ids if input_ids is None else input_ids
        real = ranges(pack.offsets[:-1], pack.seq_lens)
        return cls(
            packed=as_tensor(torch, embedding.qkv(ids, pack.position_ids), device),
            alone=as_tensor(torch, embedding.qkv(ids[real], positions_in_segments(pack.seq_lens)), device),
            alone_offsets=offsets_of(pack.seq_lens),
            cu_seqlens_padded=as_tensor(torch, pack.cu_seqlens_padded.astype(np.int32), device),
            max_seqlen=int(np.diff(pack.cu_seqlens_padded).max()),
        )


def run_packed(torch, backend: Backend, inputs: PackInputs, dtype: str):
    q, k, v = inputs.packed.to(torch_dtype(torch, dtype))
    return backend(q, k, v, inputs.cu_seqlens_padded, inputs.max_seqlen)


@dataclass
class References:
    """Per sequence of a pack, in one dtype: the fp32 reference and the same-dtype unpacked output."""

    ref: list[Any]
    unpacked_error: np.ndarray

    @classmethod
    def build(cls, torch, inputs: PackInputs, dtype: str) -> "References":
        alone = inputs.alone.to(torch_dtype(torch, dtype))
        refs, errors = [], []
        for lo, hi in zip(inputs.alone_offsets[:-1], inputs.alone_offsets[1:]):
            q, k, v = alone[:, lo:hi]
            ref = causal_attention(torch, q, k, v)
            refs.append(ref)
            errors.append(float((causal_attention(torch, q, k, v, upcast=False).float() - ref).abs().max()))
        return cls(ref=refs, unpacked_error=np.asarray(errors))


@dataclass
class PackErrors:
    packed: np.ndarray  # per sequence: max |packed - ref|
    unpacked: np.ndarray  # per sequence: max |unpacked(dtype) - ref|
    bound: float


def compare_pack(torch, pack: Pack, out, references: References, dtype: str, backend: str) -> tuple[
        list[Violation], PackErrors]:
    """The pass rule on one pack's packed output `out` (T, H, D)."""
    offsets = pack.offsets
    packed = []
    for i, ref in enumerate(references.ref):
        start = int(offsets[i])
        rows = out[start:start + int(pack.seq_lens[i])].float()
        packed.append(float((rows - ref).abs().max()))
    packed_error = np.asarray(packed)
    bound = 2 * float(references.unpacked_error.max()) + ATOL[dtype]
    bad = ~(packed_error <= bound)  # NaN fails
    found = []
    for i in np.flatnonzero(bad)[:3]:
        found.append(Violation(
            "attention", "attention-equivalence",
            f"sample {pack.sample_ids[i]}: packed attention differs from the sequence's own causal attention by "
            f"{packed_error[i]:.3g} > {bound:.3g} (2 x the unpacked {dtype} error + {ATOL[dtype]:g}) "
            f"[{backend} {dtype}]: it sees tokens outside itself, or its boundaries (cu_seqlens_padded) or "
            "position_ids are wrong", **pack.where(int(i))))
    if bad.sum() > 3:
        found.append(Violation("attention", "attention-equivalence",
                               f"{int(bad.sum()) - 3} more sequences of this pack differ [{backend} {dtype}]",
                               shard=pack.shard, row=pack.row, count=int(bad.sum()) - 3))
    return found, PackErrors(packed=packed_error, unpacked=references.unpacked_error, bound=bound)


def check_pack_attention(pack: Pack, backend: Backend, dtype: str, embedding: ProbeEmbedding) -> tuple[
        list[Violation], PackErrors | None]:
    """Packed varlen attention of one pack against each sequence's own causal attention.

    Runs on the columns as given, so it judges a pack on its own, whatever the structure check said:

        >>> pack = Pack(...)                       # doctest: +SKIP
        >>> pack.position_ids[:] = np.arange(len(pack.position_ids))   # not reset at sequence starts
        >>> check_pack_attention(pack, SdpaBackend(torch, "cpu"), "fp32", ProbeEmbedding())[0][0].rule
        'attention-equivalence'
    """
    torch = backend.torch
    problem = pack.unusable()
    if problem is not None:
        return [Violation("attention", "attention-layout", f"no varlen kernel can run on this pack: {problem}",
                          **pack.where())], None
    inputs = PackInputs.build(torch, pack, embedding, backend.device)
    with torch.no_grad():
        out = run_packed(torch, backend, inputs, dtype)
        return compare_pack(torch, pack, out, References.build(torch, inputs, dtype), dtype, backend.name)


TREE_ATOL = 1e-9  # both sides in float64 over the same numbers: only the summation order differs


def check_tree_attention(pack: Pack, embedding: ProbeEmbedding) -> tuple[list[Violation], np.ndarray]:
    """A tree pack (--share-prefix) against its rows one by one, in float64 numpy: attention over the
    whole pack under the tree's visibility (`packctl.contract.tree.visible`: causal in a segment, the
    true tokens of its ancestors, never a sibling or padding) at the pack's position_ids, and each
    row rebuilt from its chain (`row_positions`) attended causally alone at positions 0..n-1; the
    rows of the pack's output at the row's flat positions must equal the row's own. Varlen kernels
    cannot express a tree, so no backend runs here. Returns the violations and each row's error.

        segments [1 2 3] [4 7 8] [4 9], parents [-1 0 0]: row 6 = flat [0 1 2 6 7] at positions
        0 1 2 3 4, compared with attn([1 2 3 4 9]) at 0..4
    """
    from packctl.contract.tree import row_positions, visible
    try:
        mask = visible(pack.parent_segments, pack.seq_lens, pack.seq_lens_padded)
        rows = row_positions(pack.parent_segments, pack.seq_lens, offsets_of(pack.seq_lens_padded),
                             pack.sample_ids)
    except ValueError as exc:
        return [Violation("attention", "attention-layout", f"the tree cannot be attended over: {exc}",
                          **pack.where())], np.zeros(0)
    out = _masked_attention(embedding.qkv(pack.input_ids, pack.position_ids).astype(np.float64), mask)
    errors, found = [], []
    for k, segment in enumerate(rows.segments.tolist()):
        where = rows.row(k)
        alone = embedding.qkv(pack.input_ids[where], np.arange(len(where))).astype(np.float64)
        own = _masked_attention(alone, np.tril(np.ones((len(where), len(where)), dtype=bool)))
        errors.append(float(np.abs(out[where] - own).max()) if len(where) else 0.0)
        if not errors[-1] <= TREE_ATOL and len(found) < 3:
            found.append(Violation(
                "attention", "attention-equivalence",
                f"sample {pack.sample_ids[segment]}: attention over the tree differs from the row's own causal "
                f"attention by {errors[-1]:.3g} > {TREE_ATOL:g} [numpy fp64]: it sees a sibling or padding, or its "
                "parent_segments or position_ids are wrong", **pack.where(segment)))
    return found, np.asarray(errors)


def _masked_attention(qkv: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """softmax(q k^T / sqrt(D) where `mask`) v, (T, H, D) from qkv (3, T, H, D); a row that sees
    nothing (padding with no key in view) gives 0."""
    q, k, v = (np.transpose(t, (1, 0, 2)) for t in qkv)
    scores = np.matmul(q, np.transpose(k, (0, 2, 1))) / math.sqrt(q.shape[-1])
    scores = np.where(mask[None], scores, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(top), top, 0))
    total = weights.sum(axis=-1, keepdims=True)
    out = np.matmul(weights / np.where(total > 0, total, 1), v)
    return np.transpose(out, (1, 0, 2))


def probe_contamination(pack: Pack, backend: Backend, dtype: str, embedding: ProbeEmbedding, sequence: int, *,
                        baseline=None) -> tuple[list[Violation], float]:
    """Change the tokens of `sequence`; the output rows of every other sequence must not move.

    Returns the violations and the largest change seen outside the changed sequence. On CPU the
    rows must be bitwise identical; on CUDA within atol.
    """
    torch = backend.torch
    offsets = pack.offsets
    lo, hi = int(offsets[sequence]), int(offsets[sequence + 1])
    changed_ids = pack.input_ids.copy()
    changed_ids[lo:lo + int(pack.seq_lens[sequence])] ^= _PERTURB
    with torch.no_grad():
        if baseline is None:
            baseline = run_packed(torch, backend, PackInputs.build(torch, pack, embedding, backend.device), dtype)
        after = run_packed(torch, backend, PackInputs.build(torch, pack, embedding, backend.device, changed_ids), dtype)
    delta = (after.float() - baseline.float()).abs().amax(dim=(1, 2)).cpu().numpy()
    delta[lo:hi] = 0.0
    tolerance = 0.0 if backend.device == "cpu" else ATOL[dtype]
    largest = float(np.nan_to_num(delta, nan=np.inf).max()) if len(delta) else 0.0
    moved = ~(delta <= tolerance)
    found = []
    if moved.any():
        token = int(np.argmax(moved))
        victim = int(np.searchsorted(offsets, token, side="right") - 1)
        found.append(Violation(
            "contamination", "contamination",
            f"changing the tokens of sequence {sequence} (sample {pack.sample_ids[sequence]}) changed the attention "
            f"output of sample {pack.sample_ids[victim]} by {delta[token]:.3g} at token {token} of the pack "
            f"[{backend.name} {dtype}]: attention crosses sequence boundaries", **pack.where(victim),
            count=int(moved.sum())))
    return found, largest


@dataclass
class BenchResult:
    backend: str
    dtype: str
    device: str
    packs: int
    packed_ms: float
    padded_ms: float
    tokens_packed: int
    tokens_padded: int
    tokens_real: int
    repeats: int
    padded_batch: int

    @property
    def speedup(self) -> float:
        return self.padded_ms / self.packed_ms if self.packed_ms > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "dtype": self.dtype, "device": self.device, "packs": self.packs,
                "packed_ms": self.packed_ms, "padded_ms": self.padded_ms, "speedup": self.speedup,
                "tokens_packed": self.tokens_packed, "tokens_padded": self.tokens_padded,
                "tokens_real": self.tokens_real, "repeats": self.repeats,
                "padded_batch": self.padded_batch}


def bench_attention(packs: list[Pack], backend: Backend, dtype: str, embedding: ProbeEmbedding, *,
                    repeats: int = 3) -> BenchResult:
    """Time packed varlen attention against padded batching of the same sequences.

    Packed: one varlen call per pack (a micro-batch of one pack). Padded: what a trainer without
    packing computes, the same sequences in input (sample id) order, in batches of as many
    sequences as a pack holds on average, each batch padded to its longest, causal SDPA. Both run
    once untimed, then `repeats` times; the median of the total is reported.
    """
    torch = backend.torch
    dt = torch_dtype(torch, dtype)
    packed_inputs, alone = [], []
    for pack in packs:
        inputs = PackInputs.build(torch, pack, embedding, backend.device)
        q, k, v = inputs.packed.to(dt)
        packed_inputs.append((q, k, v, inputs.cu_seqlens_padded, inputs.max_seqlen))
        for i, (lo, hi) in enumerate(zip(inputs.alone_offsets[:-1], inputs.alone_offsets[1:])):
            alone.append((int(pack.sample_ids[i]), len(alone), inputs.alone[:, lo:hi].to(dt)))
    sequences = [x for _, _, x in sorted(alone, key=lambda item: item[:2])]  # input order; pieces in order
    batch = max(1, round(len(sequences) / len(packs)))
    padded_inputs, tokens_padded = [], 0
    for b0 in range(0, len(sequences), batch):
        group = sequences[b0:b0 + batch]
        longest = max(x.shape[1] for x in group)
        padded = torch.zeros(3, len(group), embedding.heads, longest, embedding.head_dim, dtype=dt,
                             device=backend.device)
        for i, x in enumerate(group):
            padded[:, i, :, :x.shape[1]] = x.transpose(1, 2)
        padded_inputs.append(padded)
        tokens_padded += len(group) * longest

    def sync() -> None:
        if backend.device == "cuda":
            torch.cuda.synchronize()

    def run_packed_all() -> None:
        for q, k, v, cu, longest in packed_inputs:
            backend(q, k, v, cu, longest)

    def run_padded_all() -> None:
        for q, k, v in padded_inputs:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def timed(fn) -> float:
        times = []
        with torch.no_grad():
            fn()
            sync()
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                sync()
                times.append(time.perf_counter() - t0)
        return 1000 * float(np.median(times))

    return BenchResult(backend=backend.name, dtype=dtype, device=backend.device, packs=len(packs),
                       packed_ms=timed(run_packed_all), padded_ms=timed(run_padded_all),
                       tokens_packed=sum(len(p.input_ids) for p in packs), tokens_padded=tokens_padded,
                       tokens_real=sum(int(p.seq_lens.sum()) for p in packs), repeats=repeats,
                       padded_batch=batch)


@dataclass
class AttentionRun:
    """Results of the attention, contamination and bench checks over the sampled packs."""

    violations: list[Violation] = field(default_factory=list)
    results: list[dict[str, Any]] = field(default_factory=list)
    contamination: list[dict[str, Any]] = field(default_factory=list)
    bench: list[dict[str, Any]] = field(default_factory=list)
    contamination_seconds: float = 0.0  # of the run's seconds, those of the contamination probes
    bench_seconds: float = 0.0  # and those of the bench


def run_attention(packs: list[Pack], backends: list[Backend], dtypes: list[str], embedding: ProbeEmbedding, *,
                  seed: int = 0, bench: bool = False, advance: Callable[[int], None] = lambda n: None
                  ) -> AttentionRun:
    """Every (backend, dtype) over every sampled pack; the contamination probe (and the bench) with
    each backend's first supported dtype. `advance(1)` after each pack (progress)."""
    run = AttentionRun()
    if not backends:
        return run
    tally = _Tally.start(backends, dtypes, embedding, run)
    rng = np.random.default_rng(seed)
    with backends[0].torch.no_grad():
        for pack in packs:
            tally.check(pack, rng)
            advance(1)
    run.results = list(tally.stats.values())
    run.contamination = list(tally.probes.values())
    if bench and packs:
        started = time.perf_counter()
        run.bench = tally.bench(packs)
        run.bench_seconds = time.perf_counter() - started
    return run


@dataclass
class _Tally:
    """The attention checks of one run, pack by pack: one result per (backend, dtype) (`stats`,
    AttentionRun.results: packs, sequences, worst errors, status), the dtype each backend probes
    contamination and benches with (its first supported one, `probe_dtype`), one probe result per
    backend (`probes`); broken rules go to `run`.

        backends [sdpa], dtypes [fp32, bf16] on CPU: stats for (sdpa, fp32) and (sdpa, bf16),
        probe_dtype {sdpa: fp32}, bitwise probes (exact)"""

    backends: list[Backend]
    dtypes: list[str]
    embedding: ProbeEmbedding
    run: AttentionRun
    stats: dict[tuple[str, str], dict[str, Any]]
    probe_dtype: dict[str, str]
    probes: dict[str, dict[str, Any]]

    @classmethod
    def start(cls, backends: list[Backend], dtypes: list[str], embedding: ProbeEmbedding, run: AttentionRun
              ) -> "_Tally":
        """Each (backend, dtype) run or skipped, with why (a dtype the backend does not take, or a
        failed probe of it), before any pack."""
        stats: dict[tuple[str, str], dict[str, Any]] = {}
        probe_dtype: dict[str, str] = {}
        for backend in backends:
            for dtype in dtypes:
                reason = backend.unsupported(dtype)
                if reason is None and hasattr(backend, "probe"):
                    reason = backend.probe(dtype)
                stats[backend.name, dtype] = {"backend": backend.name, "dtype": dtype, "mode": backend.mode,
                                              "status": "skipped" if reason else "ok", "reason": reason, "packs": 0,
                                              "sequences": 0, "max_error_packed": 0.0, "max_error_unpacked": 0.0,
                                              "bound": None, "worst_ratio": None,
                                              "atol": ATOL[dtype]}
                if reason is None and backend.name not in probe_dtype:
                    probe_dtype[backend.name] = dtype
        probes = {name: {"backend": name, "dtype": dt, "packs": 0, "max_change": 0.0, "status": "ok",
                         "exact": backends[0].device == "cpu"} for name, dt in probe_dtype.items()}
        return cls(backends=backends, dtypes=dtypes, embedding=embedding, run=run, stats=stats,
                   probe_dtype=probe_dtype, probes=probes)

    def check(self, pack: Pack, rng: np.random.Generator) -> None:
        """One sampled pack: a tree pack in numpy, a pack no varlen kernel can run refused, any
        other through every running (backend, dtype)."""
        if pack.parent_segments is not None:  # a tree: no varlen kernel expresses it (numpy, once)
            found, errors = check_tree_attention(pack, self.embedding)
            self.run.violations += found
            for entry in self._running():
                entry["packs"] += 1
                entry["sequences"] += len(errors)
                entry["max_error_packed"] = max(entry["max_error_packed"], float(errors.max(initial=0.0)))
                entry["status"] = "failed" if found else entry["status"]
            return
        problem = pack.unusable()
        if problem is not None:
            self.run.violations.append(Violation("attention", "attention-layout",
                                                 f"no varlen kernel can run on this pack: {problem}", **pack.where()))
            for entry in self._running():
                entry["status"] = "failed"
            return
        self._check_varlen(pack, rng)

    def _running(self) -> list[dict[str, Any]]:
        return [entry for entry in self.stats.values() if entry["status"] != "skipped"]

    def _check_varlen(self, pack: Pack, rng: np.random.Generator) -> None:
        """Each running backend's packed attention against each sequence's own, dtype by dtype;
        the contamination probe changes one sequence (drawn from `rng`) in the probe dtype."""
        torch, device = self.backends[0].torch, self.backends[0].device
        inputs = PackInputs.build(torch, pack, self.embedding, device)
        probed = int(rng.integers(len(pack.seq_lens))) if len(pack.seq_lens) > 1 else None
        for dtype in self.dtypes:
            active = [b for b in self.backends if self.stats[b.name, dtype]["status"] != "skipped"]
            if not active:
                continue
            references = References.build(torch, inputs, dtype)
            for backend in active:
                out = run_packed(torch, backend, inputs, dtype)
                self._record(self.stats[backend.name, dtype],
                             *compare_pack(torch, pack, out, references, dtype, backend.name))
                if probed is not None and self.probe_dtype.get(backend.name) == dtype:
                    self._probe(pack, backend, dtype, probed, out)

    def _record(self, entry: dict[str, Any], found: list[Violation], errors: PackErrors) -> None:
        """One pack's errors of one (backend, dtype) added to its result `entry`."""
        worst = float(np.nan_to_num(errors.packed, nan=np.inf).max())
        entry["packs"] += 1
        entry["sequences"] += len(errors.packed)
        entry["max_error_packed"] = max(entry["max_error_packed"], worst)
        entry["max_error_unpacked"] = max(entry["max_error_unpacked"], float(errors.unpacked.max()))
        ratio = worst / errors.bound
        if entry["worst_ratio"] is None or ratio > entry["worst_ratio"]:
            entry["worst_ratio"], entry["bound"] = ratio, errors.bound
        if found:
            entry["status"] = "failed"
            self.run.violations += found

    def _probe(self, pack: Pack, backend: Backend, dtype: str, sequence: int, baseline) -> None:
        """The contamination probe of one pack: `sequence` changed, every other's output the same."""
        started = time.perf_counter()
        found, change = probe_contamination(pack, backend, dtype, self.embedding, sequence, baseline=baseline)
        self.run.contamination_seconds += time.perf_counter() - started
        probe = self.probes[backend.name]
        probe["packs"] += 1
        probe["max_change"] = max(probe["max_change"], change)
        if found:
            probe["status"] = "failed"
            self.run.violations += found

    def bench(self, packs: list[Pack]) -> list[dict[str, Any]]:
        """Packed against padded attention (`bench_attention`) for each backend that runs, in its
        probe dtype, over the packs a varlen kernel can run."""
        usable = [p for p in packs if p.unusable() is None]
        return [bench_attention(usable, backend, self.probe_dtype[backend.name], self.embedding).to_dict()
                for backend in self.backends if backend.name in self.probe_dtype and usable]
