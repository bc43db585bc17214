"""Shared by the tests/test_torch_*.py files: a tiny Hugging Face Llama with random weights, the
unpacked reference (each sequence alone, read from the source Parquet, not from the packs) and the
packed run, both reduced to per-token losses and parameter gradients.

The loss is the usual causal-LM loss: logits[i] predicts labels[i + 1]; the sum of the per-token
losses over the labels that are not -100, divided by their count. The unpacked run divides by the
same count, so the two losses and their gradients are equal when packing changes nothing.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

IGNORE_INDEX = -100


def tiny_llama(seed: int = 0, vocab_size: int = 32000):
    """LlamaForCausalLM (RMSNorm, rotary embeddings from position_ids, SwiGLU, grouped-query causal
    attention) from a small config, random weights, SDPA attention, fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.2, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float().train()


@dataclass
class Piece:
    """One sequence of the packed output, and its tokens and labels read from the source."""

    sample_id: int
    start: int  # offset inside the source sample (> 0 for the later pieces of a split sample)
    tokens: np.ndarray
    labels: np.ndarray


def source_pieces(out: Path, packs: list[int]) -> list[list[Piece]]:
    """The pieces of the given packs (output order), taken from the source shards by global id.

    A split sample's pieces appear in output order, so a piece starts where the pieces of the same
    sample before it in the output end.
    """
    manifest = json.loads((out / "_manifest.json").read_text())
    offsets, files = [0], []
    for entry in manifest["inputs"]:
        files.append(entry["path"])
        offsets.append(offsets[-1] + entry["rows"])
    tables: dict[int, dict[str, list]] = {}

    def source(gid: int) -> tuple[np.ndarray, np.ndarray]:
        f = int(np.searchsorted(offsets, gid, side="right") - 1)
        if f not in tables:
            tables[f] = pq.read_table(files[f], columns=["input_ids", "labels"]).to_pydict()
        row = gid - offsets[f]
        return np.array(tables[f]["input_ids"][row]), np.array(tables[f]["labels"][row])

    wanted = set(packs)
    consumed: dict[int, int] = {}
    found: dict[int, list[Piece]] = {}
    row = 0
    for shard in manifest["shards"]:
        table = pq.read_table(out / shard["path"], columns=["sample_ids", "seq_lens"]).to_pydict()
        for gids, lens in zip(table["sample_ids"], table["seq_lens"]):
            pieces = []
            for gid, n in zip(gids, lens):
                start = consumed.get(gid, 0)
                consumed[gid] = start + n
                if row in wanted:
                    tokens, labels = source(gid)
                    pieces.append(Piece(gid, start, tokens[start:start + n], labels[start:start + n]))
            if row in wanted:
                found[row] = pieces
            row += 1
    return [found[p] for p in packs]


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position loss of logits [T, V] against unshifted labels [T]: (losses [T-1], valid [T-1])."""
    targets = labels[1:]
    losses = torch.nn.functional.cross_entropy(logits[:-1].float(), targets.clamp(min=0), reduction="none")
    valid = targets != IGNORE_INDEX
    return losses * valid, valid


@dataclass
class Run:
    per_token: torch.Tensor  # losses of the valid targets, in sequence order
    loss: torch.Tensor  # their sum / count
    grads: dict[str, torch.Tensor]
    model_loss: torch.Tensor | None = None  # the model's own loss, when it was given labels


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def unpacked_run(model, pieces: list[Piece]) -> Run:
    """Each sequence alone: its own forward at positions 0..n-1 with the plain causal mask."""
    model.zero_grad(set_to_none=True)
    per_token, sums, count = [], [], 0
    for piece in pieces:
        tokens = torch.from_numpy(piece.tokens.astype(np.int64))[None]
        logits = model(input_ids=tokens).logits[0]
        losses, valid = token_losses(logits, torch.from_numpy(piece.labels.astype(np.int64)))
        per_token.append(losses[valid])
        sums.append(losses.sum())
        count += int(valid.sum())
    loss = torch.stack(sums).sum() / count
    loss.backward()
    return Run(torch.cat(per_token).detach(), loss.detach(), _grads(model))


def packed_run(model, inputs: dict, labels: torch.Tensor, seq_starts: list[tuple[int, int]], *,
               backward: bool = True) -> Run:
    """One forward over the packed row [1, T] (`inputs` go to the model as they are); per-token
    losses gathered sequence by sequence.

    `seq_starts` lists (offset in the row, true length) of every sequence, so the losses come out
    in the same order as `unpacked_run`'s; every other position must have an ignored target. When
    `inputs` hold `labels`, the model's own loss is kept in `Run.model_loss`. Without `backward`,
    `Run.grads` is empty.
    """
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(backward):
        output = model(**inputs)
    losses, valid = token_losses(output.logits[0], labels[0])
    covered = torch.zeros_like(valid)
    per_token = []
    for start, n in seq_starts:
        span = slice(start, start + n - 1)
        per_token.append(losses[span][valid[span]])
        covered[span] = True
    assert not (valid & ~covered).any(), "a padding or boundary position has a target"
    loss = losses.sum() / valid.sum()
    if backward:
        loss.backward()
    model_loss = output.loss.detach() if getattr(output, "loss", None) is not None else None
    return Run(torch.cat(per_token).detach(), loss.detach(), _grads(model), model_loss)


def seq_starts_of(packs: list[dict]) -> list[tuple[int, int]]:
    """(offset in the collated row, true length) of every sequence of the packs, in order."""
    out, base = [], 0
    for p in packs:
        for start, n in zip(np.asarray(p["cu_seqlens_padded"])[:-1], p["seq_lens"]):
            out.append((base + int(start), int(n)))
        base += len(p["input_ids"])
    return out


def max_differences(a: Run, b: Run) -> dict[str, float]:
    assert a.per_token.shape == b.per_token.shape, (a.per_token.shape, b.per_token.shape)
    out = {"loss": float((a.loss - b.loss).abs()), "per_token": float((a.per_token - b.per_token).abs().max())}
    if a.grads and b.grads:
        assert a.grads.keys() == b.grads.keys()
        out["grad"] = max(float((a.grads[k] - b.grads[k]).abs().max()) for k in a.grads)
    return out
