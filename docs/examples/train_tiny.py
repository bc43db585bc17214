"""Train a tiny Llama on sample_data for a few steps, packed and unpacked, and print both losses.

    pip install 'packctl[dev]'            # torch and transformers
    python docs/examples/train_tiny.py    # CPU, fp32, well under a minute
    python docs/examples/train_tiny.py --device cuda --attention flash-attn   # a GPU, 'packctl[gpu]'

Packed: the packs of `packctl pack sample_data --capacity 256 --too-long split`, four per step, laid
end to end in one [1, T] row (`collate_hf`); the model finds the sequence boundaries from the
position_ids, which restart at 0 at every sequence. Unpacked: the same sequences as an ordinary
right-padded batch with an attention mask. Both models start from the same random weights and take
the same AdamW steps, and both losses are the mean over the same targets, so the two columns agree
to float rounding at step 0 and stay together.

`--attention` picks the packed model's attention: `hf` (transformers' SDPA with the block-causal
mask it derives from position_ids), or one of packctl's varlen kernels (`flash-attn`,
`torch-varlen`, `flex`, `sdpa`; `packctl.torch.varlen_attention`) called with the batch's
cu_seq_lens, as a trainer with flash-attn runs it. flash-attn and torch-varlen take fp16/bf16: q, k
and v enter the kernel in `--attention-dtype` (bf16 for them, else fp32) and the output leaves in
the model's dtype, so their losses differ from the fp32 unpacked ones by bf16 rounding (about 1e-3).
"""
from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

import packctl
from packctl.torch import PackedDataset, collate_hf, varlen_attention

IGNORE_INDEX = -100


def tiny_llama(seed: int, head_dim: int | None = None) -> LlamaForCausalLM:
    """hidden 32, 4 query heads and 2 key/value heads of head_dim (32 / 4 = 8 unless given)."""
    config = LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
                         tie_word_embeddings=False, use_cache=False, head_dim=head_dim)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float().train()


def register_varlen_attention(backend: str, dtype: torch.dtype) -> str:
    """Register packctl's varlen kernel `backend` as a transformers attention implementation and
    return its name. transformers hands it q [1, Hq, T, D], k and v [1, Hkv, T, D] and collate_hf's
    cu_seq_lens_q / max_length_q; it returns the output as [1, T, Hq, D], as transformers' own do."""
    from transformers import AttentionInterface

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))
        out = varlen_attention(q, k, v, kwargs["cu_seq_lens_q"], kwargs["max_length_q"], softmax_scale=scaling,
                               backend=backend)
        return out.to(query.dtype).unsqueeze(0), None

    name = f"packctl_{backend.replace('-', '_')}"
    AttentionInterface.register(name, attention)
    return name


def padded_batch(packs: list[dict]) -> dict[str, torch.Tensor]:
    """The sequences of the packs as a right-padded batch [B, max_len]: what training looks like
    without packing."""
    sequences = []
    for p in packs:
        for start, n in zip(p["cu_seqlens_padded"][:-1].tolist(), p["seq_lens"].tolist()):
            sequences.append((p["input_ids"][start:start + n], p["labels"][start:start + n]))
    width = max(len(tokens) for tokens, _ in sequences)
    input_ids = torch.zeros(len(sequences), width, dtype=torch.int64)
    labels = torch.full((len(sequences), width), IGNORE_INDEX, dtype=torch.int64)
    attention_mask = torch.zeros(len(sequences), width, dtype=torch.int64)
    for row, (tokens, targets) in enumerate(sequences):
        input_ids[row, :len(tokens)] = torch.from_numpy(tokens.astype("int64"))
        labels[row, :len(tokens)] = torch.from_numpy(targets.astype("int64"))
        attention_mask[row, :len(tokens)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


def main() -> None:
    repo = Path(__file__).resolve().parents[2]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(repo / "sample_data"), help="tokenized Parquet input")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--packs-per-step", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--attention", default="hf", choices=["hf", "flash-attn", "torch-varlen", "flex", "sdpa"],
                        help="the packed model's attention (see above)")
    parser.add_argument("--attention-dtype", choices=["fp32", "bf16", "fp16"],
                        help="dtype of q, k, v in a packctl kernel [bf16 for flash-attn and torch-varlen, else fp32]")
    parser.add_argument("--head-dim", type=int, help="attention head size [8]; GPU kernels want 64 or 128")
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    half = args.attention in ("flash-attn", "torch-varlen")
    attention_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        args.attention_dtype or ("bf16" if half else "fp32")]

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "packed"
        packctl.pack(packctl.PackConfig(inputs=[args.data], output=str(out), capacity=args.capacity,
                                        too_long="split"))

        dataset = PackedDataset(out)
        # each step: the packs as one packed row, and the same sequences as a padded batch
        loader = DataLoader(dataset, batch_size=args.packs_per_step,
                            collate_fn=lambda packs: (collate_hf(packs), padded_batch(packs)))
        packed_model = tiny_llama(seed=0, head_dim=args.head_dim).to(args.device)
        unpacked_model = copy.deepcopy(packed_model)
        if args.attention != "hf":
            packed_model.config._attn_implementation = register_varlen_attention(args.attention, attention_dtype)
        packed_opt = torch.optim.AdamW(packed_model.parameters(), lr=args.lr)
        unpacked_opt = torch.optim.AdamW(unpacked_model.parameters(), lr=args.lr)

        print(f"packed output: {len(dataset)} packs of capacity {args.capacity}, {args.packs_per_step} per step; "
              f"attention {args.attention} on {args.device}")
        print(f"{'step':>4} {'sequences':>9} {'packed loss':>12} {'unpacked loss':>14} {'|diff|':>9}")
        for step, (batch, padded) in zip(range(args.steps), loader):
            batch, padded = (to_device(b, args.device) for b in (batch, padded))
            packed_loss = packed_model(**batch).loss
            packed_loss.backward()
            packed_opt.step()
            packed_opt.zero_grad()

            unpacked_loss = unpacked_model(**padded).loss
            unpacked_loss.backward()
            unpacked_opt.step()
            unpacked_opt.zero_grad()

            diff = abs(packed_loss.item() - unpacked_loss.item())
            print(f"{step:>4} {len(padded['input_ids']):>9} {packed_loss.item():>12.6f} "
                  f"{unpacked_loss.item():>14.6f} {diff:>9.1e}")


def to_device(batch: dict, device: str) -> dict:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}


if __name__ == "__main__":
    main()
