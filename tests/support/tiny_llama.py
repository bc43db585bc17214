"""A tiny Hugging Face Llama (random weights, fp32, CPU) and the references the shared-prefix proofs
hold packed runs against: each row run alone, its target log-probabilities, DPO and GRPO losses,
and the tolerances. Needs torch and transformers (import it after `pytest.importorskip`).

    model = tiny_llama(0, "sdpa")
    logits, logp, valid = alone(model, [5, 9, 11], [-100, 9, 11])    # the row by itself
"""
from __future__ import annotations

import torch

IGNORE_INDEX = -100
TOLERANCE = 1e-5
BETA = 0.1
# eager takes the additive float mask, sdpa the boolean one
ATTENTION = [("eager", torch.float32), ("sdpa", torch.bool)]


def tiny_llama(seed: int, attn: str, vocab: int = 300):
    """LlamaForCausalLM: 2 layers, hidden 64, 4 heads (2 key/value heads), fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.2, tie_word_embeddings=False, attn_implementation=attn)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float().train()


def alone(model, tokens: list[int], packed_labels: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The row run by itself: (logits [n, V], log p of each target, valid [n-1]); `packed_labels`
    are the row's labels with the first -100, as a pack holds them."""
    logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
    targets = torch.tensor(packed_labels[1:], dtype=torch.long)
    valid = targets != IGNORE_INDEX
    logp = -torch.nn.functional.cross_entropy(logits[:-1], targets.clamp(min=0), reduction="none")
    return logits, logp[valid], valid


def packed_logits(model, batch, dtype):
    """The model over a `collate_tree` batch with its dense tree mask."""
    from packctl.torch import tree_attention_mask

    mask = tree_attention_mask(batch, dtype=dtype)
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], attention_mask=mask,
                 use_cache=False).logits


def grads(model) -> dict[str, torch.Tensor]:
    """The model's gradients, then cleared."""
    out = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def assert_close(packed: torch.Tensor, unshared: torch.Tensor):
    """Within TOLERANCE of the unshared loss, relative to it or to 1 when it is smaller (a GRPO
    loss is a sum of terms that cancel)."""
    assert abs(float(packed) - float(unshared)) <= TOLERANCE * max(1.0, abs(float(unshared)))


def assert_same_grads(packed: dict, unshared: dict):
    assert packed.keys() == unshared.keys() and packed
    for name in packed:
        scale = float(unshared[name].abs().max())
        assert float((packed[name] - unshared[name]).abs().max()) <= TOLERANCE * max(scale, 1e-12), name


def dpo_loss(logps: torch.Tensor, ref: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
    """-log sigmoid(beta * margin), the mean over (chosen, rejected) pairs of row indices."""
    chosen, rejected = torch.tensor([c for c, _ in pairs]), torch.tensor([r for _, r in pairs])
    margin = (logps[chosen] - ref[chosen]) - (logps[rejected] - ref[rejected])
    return -torch.nn.functional.logsigmoid(BETA * margin).mean()


def grpo_loss(logps: torch.Tensor, counts: torch.Tensor, group: list[int], rewards: torch.Tensor) -> torch.Tensor:
    """On-policy GRPO: advantage (r - mean) / std of the group, each rollout's token mean."""
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    index = torch.tensor(group)
    return -(advantages * logps[index] / counts[index].clamp(min=1)).mean()


def unshared_logps(model, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (tokens, packed_labels) row alone: (sum of its target log p, its target count)."""
    parts = [alone(model, tokens, labels)[1] for tokens, labels in rows]
    return torch.stack([p.sum() for p in parts]), torch.tensor([len(p) for p in parts])
