"""packctl verify's attention checks on CPU: the backends agree with the fp32 reference, and the
attention check itself catches broken packs when it is given their columns directly."""
from __future__ import annotations

import json
import sys
import types

import numpy as np
import pyarrow.parquet as pq
import pytest

torch = pytest.importorskip("torch")

from typer.testing import CliRunner  # noqa: E402

from support.runs import pack_to  # noqa: E402
from packctl import PackctlError  # noqa: E402
from packctl.cli import app  # noqa: E402
from packctl.errors import MissingExtraError  # noqa: E402
from packctl.verify import VerifyOptions, verify  # noqa: E402
from packctl.verify.attention import (  # noqa: E402
    Pack,
    ProbeEmbedding,
    bench_attention,
    check_pack_attention,
    probe_contamination,
    run_attention,
)
from packctl.verify.backends import (  # noqa: E402
    Backend,
    FlashAttnBackend,
    FlexBackend,
    SdpaBackend,
    TorchVarlenBackend,
    select_backends,
)
from packctl.verify.shard_rules import rows_from_table  # noqa: E402

EMBEDDING = ProbeEmbedding(seed=0, heads=2, head_dim=64)


@pytest.fixture(scope="module")
def small_output(tmp_path_factory, sample_data):
    """sample_data packed into 1024-token packs with cp 2 (so packs hold several sequences)."""
    _, out = pack_to(tmp_path_factory.mktemp("att"), [sample_data], capacity=1024, too_long="split", cp_size=2)
    return out


@pytest.fixture(scope="module")
def packs(small_output):
    table = pq.read_table(small_output / "data/train-00000.parquet")
    rows, problems = rows_from_table(table, shard="data/train-00000.parquet")
    assert not problems
    many = [r for r in range(rows.num_rows) if len(table.column("seq_lens")[r]) >= 3]
    return [Pack.from_rows(rows, r, "data/train-00000.parquet") for r in many[:3]]


@pytest.fixture(scope="module")
def sdpa():
    return SdpaBackend(torch, "cpu")


def test_cpu_backends_match_the_fp32_reference(packs, sdpa):
    run = run_attention(packs, [sdpa, FlexBackend(torch, "cpu")], ["fp32"], EMBEDDING)
    assert run.violations == []
    for result in run.results:
        assert result["status"] == "ok" and result["packs"] == 3
        assert result["max_error_packed"] <= 1e-5, result
    for probe in run.contamination:
        assert probe["status"] == "ok" and probe["max_change"] == 0.0 and probe["exact"]


def test_half_precision_follows_the_two_times_rule(packs, sdpa):
    run = run_attention(packs[:2], [sdpa], ["bf16", "fp16"], EMBEDDING)
    assert run.violations == []
    for result in run.results:
        assert result["status"] == "ok"
        assert 0 < result["max_error_packed"] <= 2 * result["max_error_unpacked"] + result["atol"]


def _copy(pack: Pack) -> Pack:
    return Pack(**{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in vars(pack).items()})


def test_position_ids_not_reset_is_caught_by_attention_alone(packs, sdpa):
    pack = _copy(packs[0])
    pack.position_ids = np.arange(len(pack.position_ids), dtype=pack.position_ids.dtype)
    found, errors = check_pack_attention(pack, sdpa, "fp32", EMBEDDING)
    assert found and found[0].rule == "attention-equivalence"
    assert (found[0].shard, found[0].row, found[0].sequence) == (pack.shard, pack.row, 1)
    assert errors.packed[0] <= errors.bound < errors.packed[1]  # the first sequence still starts at 0


def test_constant_position_offset_is_caught_although_rotary_ignores_it(packs, sdpa):
    # Rotary embedding alone is blind to a shift of all positions of a sequence; the probe's
    # absolute position term is not.
    pack = _copy(packs[0])
    second = slice(int(pack.cu_seqlens_padded[1]), int(pack.cu_seqlens_padded[2]))
    pack.position_ids[second] += 100
    found, _ = check_pack_attention(pack, sdpa, "fp32", EMBEDDING)
    assert [v.sequence for v in found] == [1]


@pytest.mark.parametrize("shift", [1, -1])
def test_cu_seqlens_padded_off_by_one_is_caught_by_attention_alone(packs, sdpa, shift):
    pack = _copy(packs[0])
    pack.cu_seqlens_padded[1] += shift
    found, _ = check_pack_attention(pack, sdpa, "fp32", EMBEDDING)
    assert found and all(v.rule == "attention-equivalence" for v in found)
    assert {v.sequence for v in found} & {0, 1}


def test_merged_sequences_attend_across_and_the_probe_sees_it(packs, sdpa):
    pack = _copy(packs[0])
    pack.cu_seqlens_padded = np.array([0, len(pack.input_ids)])  # one segment: cross-sequence attention
    found, _ = check_pack_attention(pack, sdpa, "fp32", EMBEDDING)
    assert {v.sequence for v in found if v.sequence is not None} >= {1, 2}
    found, change = probe_contamination(pack, sdpa, "fp32", EMBEDDING, sequence=0)
    assert found and found[0].rule == "contamination" and change > 1e-3
    assert "changing the tokens of sequence 0" in found[0].message


class LeakyBackend(SdpaBackend):
    """Causal attention over the whole pack, ignoring cu_seqlens_padded (the classic packing bug)."""

    name = "leaky"

    def __call__(self, q, k, v, cu_seqlens_padded, max_seqlen):
        whole = torch.tensor([0, q.shape[0]], dtype=torch.int32)
        return super().__call__(q, k, v, whole, max_seqlen)


def test_contamination_probe_flags_a_leaky_kernel(packs, sdpa):
    found, change = probe_contamination(packs[0], sdpa, "fp32", EMBEDDING, sequence=0)
    assert found == [] and change == 0.0
    found, _ = probe_contamination(packs[0], LeakyBackend(torch, "cpu"), "fp32", EMBEDDING, sequence=0)
    assert found and found[0].sequence == 1 and found[0].check == "contamination"


def test_unusable_layout_is_reported_not_crashed_on(packs, sdpa):
    pack = _copy(packs[0])
    pack.cu_seqlens_padded[1] = pack.cu_seqlens_padded[2] + 1  # decreasing
    (v,), errors = check_pack_attention(pack, sdpa, "fp32", EMBEDDING)
    assert v.rule == "attention-layout" and errors is None and "is not an increasing" in v.message


def test_probe_embedding_depends_only_on_token_and_position():
    ids = np.array([5, 9, 5, 7], np.int32)
    pos = np.array([0, 1, 0, 3])
    qkv = EMBEDDING.qkv(ids, pos)
    assert qkv.shape == (3, 4, 2, 64) and qkv.dtype == np.float32
    assert np.array_equal(qkv[:, 0], qkv[:, 2])  # bitwise: same token at the same position
    assert np.array_equal(EMBEDDING.qkv(ids[2:3], pos[2:3])[:, 0], qkv[:, 2])
    assert not np.array_equal(EMBEDDING.qkv(ids[:1], np.array([5]))[:, 0], qkv[:, 0])


def test_bench_reports_both_timings(packs, sdpa):
    result = bench_attention(packs[:2], sdpa, "fp32", EMBEDDING, repeats=1)
    assert result.packed_ms > 0 and result.padded_ms > 0 and result.speedup > 0
    assert result.tokens_real == sum(int(p.seq_lens.sum()) for p in packs[:2])
    # padded baseline: the same sequences in sample-id order, batches of the mean sequences per pack
    order = np.argsort(np.concatenate([p.sample_ids for p in packs[:2]]), kind="stable")
    lengths = np.concatenate([p.seq_lens for p in packs[:2]])[order]
    batch = round(len(lengths) / 2)
    assert result.padded_batch == batch
    assert result.tokens_padded == sum(len(g) * int(g.max()) for g in np.split(lengths, range(batch, len(lengths), batch)))


def test_verify_end_to_end_with_attention_cp_and_bench(small_output, sample_data):
    report = verify(small_output, VerifyOptions(source=[str(sample_data)], sample=2, backend="sdpa",
                                                dtype="fp32,bf16", bench=True))
    assert report.ok, [str(v) for v in report.violations]
    checks = report.checks
    assert [r["dtype"] for r in checks["attention"].details["results"]] == ["fp32", "bf16"]
    assert checks["contamination"].status == "ok"
    assert checks["cp"].details["cp_size"] == 2 and len(checks["cp"].details["rank_work_real"]) == 2
    assert checks["bench"].details["results"][0]["speedup"] > 0


def test_cli_attention_json(small_output):
    result = CliRunner().invoke(app, ["verify", str(small_output), "--sample", "1", "--backend", "sdpa", "--json"])
    assert result.exit_code == 0, result.stderr
    attention = json.loads(result.stdout)["checks"]["attention"]
    assert attention["status"] == "ok" and attention["device"] == "cpu" and len(attention["packs"]) == 1
    assert set(attention["results"][0]) >= {"backend", "dtype", "max_error_packed", "max_error_unpacked", "bound",
                                            "status"}


def test_verify_attention_on_a_batch_output(tmp_path, sample_data):
    """A batch-mode output (micro-batches of rows padded to a bucketed shape, balanced over 2 ranks,
    every shape shown first) trains like its sequences alone: verify with its attention and
    contamination checks on 8 micro-batches. (tests/integration/test_batch.py verifies the batch
    outputs without them.)"""
    _, out = pack_to(tmp_path, [sample_data], mode="batch", capacity=1024, max_tokens=2048, seq_round=64,
                     shape_buckets=3, dp_size=2, micro_batches=2, warmup_shapes=True, too_long="split")
    report = verify(out, VerifyOptions(source=[str(sample_data)]))
    assert report.ok, [str(v) for v in report.violations]
    checks = report.checks
    assert checks["structure"].status == checks["conservation"].status == "ok"
    assert checks["attention"].status == checks["contamination"].status == "ok"
    assert len(checks["attention"].details["packs"]) == 8


# ------------------------------------------------------------------------------------ backend selection


def test_bad_dtype_and_backend_names():
    with pytest.raises(PackctlError, match="--dtype 'fp8': choose from fp32, bf16, fp16"):
        verify("unused", VerifyOptions(dtype="fp32,fp8", device="cpu"))
    with pytest.raises(PackctlError, match="--backend 'triton': choose one of auto, flash-attn, torch-varlen"):
        select_backends("triton", "cpu")


def test_cuda_only_backends_and_device_on_a_cpu_machine():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(PackctlError) as err:
        select_backends("torch-varlen", "cpu")
    assert "runs on cuda only" in str(err.value)
    with pytest.raises(PackctlError, match="sees no CUDA device"):
        verify("unused", VerifyOptions(device="cuda"))
    from packctl.verify.backends import resolve_device

    with pytest.raises(PackctlError, match="sees no CUDA device"):
        resolve_device("cuda")
    backends, _ = select_backends("auto", "cpu")
    assert [b.name for b in backends][:1] == ["sdpa"]


def _segment_attention(q, k, v, cu, max_seqlen):
    return SdpaBackend(torch, "cpu")(q, k, v, cu, max_seqlen)


def test_torch_varlen_call_follows_the_inspected_signature(packs, monkeypatch):
    calls = []

    def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        calls.append((cu_seq_q.dtype, max_q, is_causal))
        return _segment_attention(query, key, value, cu_seq_q, max_q)

    backend = TorchVarlenBackend(torch, "cpu")  # torch 2.13's signature: causal is window_size=(-1, 0)
    assert backend.mode == "varlen_attn(window_size=(-1, 0))"
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_attn", varlen_2_10)
    backend = TorchVarlenBackend(torch, "cpu")
    assert backend.mode == "varlen_attn(is_causal=True)"
    found, errors = check_pack_attention(packs[0], backend, "bf16", EMBEDDING)
    assert found == [] and calls[0] == (torch.int32, int(np.diff(packs[0].cu_seqlens_padded).max()), True)


def test_flash_attn_2_and_4_calls(packs, monkeypatch):
    seen = {}

    def fa2(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False):
        seen["fa2"] = causal
        return _segment_attention(q, k, v, cu_q, max_q)

    def fa4(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
            softmax_scale=None, causal=False):
        seen["fa4"] = causal
        return _segment_attention(q, k, v, cu_seqlens_q, max_seqlen_q), None  # (out, lse)

    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = fa2
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    found, _ = check_pack_attention(packs[0], FlashAttnBackend(torch, "cpu"), "fp16", EMBEDDING)
    assert found == [] and seen["fa2"] is True

    fa4_root, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = fa4
    fa4_root.cute = cute
    monkeypatch.setitem(sys.modules, "flash_attn", fa4_root)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    backend = FlashAttnBackend(torch, "cpu")
    assert "FlashAttention 4" in backend.mode
    found, _ = check_pack_attention(packs[0], backend, "bf16", EMBEDDING)
    assert found == [] and seen["fa4"] is True
    assert FlashAttnBackend(torch, "cuda").unsupported("fp32") == "flash-attn supports bf16, fp16 only"


def test_missing_flash_attn_names_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    with pytest.raises(MissingExtraError) as err:
        FlashAttnBackend(torch, "cuda")
    assert "pip install 'packctl[gpu]'" in str(err.value)


def test_backend_interface_reports_unsupported_dtype_and_device():
    class CudaOnly(Backend):
        name, devices, dtypes = "x", ("cuda",), ("bf16",)

    assert CudaOnly(torch, "cpu").unsupported("bf16") == "x runs on cuda only"
    assert CudaOnly(torch, "cuda").unsupported("fp32") == "x supports bf16 only"


def _recording_flash_attn(monkeypatch, version: int, calls: list):
    """A fake flash_attn 2 or 4 in sys.modules that records what the backend passes and answers
    the way the real entry point does (FA2: out; FA4: (out, lse))."""

    def record(args, kwargs):
        q, k, v = args[:3]
        cu = kwargs.get("cu_seqlens_q", args[3] if len(args) > 3 else None)
        max_q = kwargs.get("max_seqlen_q", args[5] if len(args) > 5 else None)
        calls.append({"positional": len(args), "keywords": sorted(kwargs), "dtypes": {q.dtype, k.dtype, v.dtype},
                      "contiguous": all(t.is_contiguous() for t in (q, k, v)), "heads": (q.shape[1], k.shape[1]),
                      "cu": (cu.dtype, cu.device, cu.is_contiguous()), "max": type(max_q), "causal": kwargs["causal"],
                      "softmax_scale": kwargs["softmax_scale"]})
        return _segment_attention(q, k, v, cu, max_q)

    def fa2(*args, **kwargs):
        return record(args, kwargs)

    def fa4(q, k, v, qv=None, **kwargs):
        assert qv is None, "FA4's fourth positional parameter is qv"
        return record((q, k, v), kwargs), torch.zeros(q.shape[1], q.shape[0])

    if version == 2:
        root = types.ModuleType("flash_attn")
        root.flash_attn_varlen_func = fa2
        monkeypatch.setitem(sys.modules, "flash_attn", root)
    else:
        root, cute = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.cute")
        cute.flash_attn_varlen_func = fa4
        root.cute = cute
        monkeypatch.setitem(sys.modules, "flash_attn", root)
        monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)


@pytest.mark.parametrize("version", [2, 4])
def test_flash_attn_call_marshals_its_arguments(version, monkeypatch):
    """What the kernels demand, pinned without a GPU: q, k, v contiguous in one half dtype, k and v
    with their own (fewer) heads, cu_seqlens contiguous int32 on q's device, the max lengths plain
    ints, causal=True; FA4 by keyword (its fourth positional is qv) and its (out, lse) unwrapped."""
    calls: list = []
    _recording_flash_attn(monkeypatch, version, calls)
    backend = FlashAttnBackend(torch, "cpu")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(4, 10, 16, generator=gen, dtype=torch.bfloat16).transpose(0, 1)  # (T, H, D), not contiguous
    k, v = (torch.randn(10, 2, 16, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, 3, 10], dtype=torch.int64)[::1]
    out = backend(q, k, v, cu, np.int64(7))
    (call,) = calls
    assert call["dtypes"] == {torch.bfloat16} and call["contiguous"] and call["heads"] == (4, 2)
    assert call["cu"] == (torch.int32, q.device, True) and call["max"] is int and call["causal"] is True
    assert call["softmax_scale"] is None
    if version == 2:
        assert call["positional"] == 7
    else:
        assert call["positional"] == 3 and "FlashAttention 4" in backend.mode
        assert {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"} <= set(call["keywords"])
    assert isinstance(out, torch.Tensor) and out.shape == (10, 4, 16)
    assert torch.equal(out, _segment_attention(q.contiguous(), k, v, cu.to(torch.int32), 7))


def test_flash_attn_refuses_fp32_in_one_line(monkeypatch):
    _recording_flash_attn(monkeypatch, 4, [])
    x = torch.zeros(4, 1, 8)
    with pytest.raises(PackctlError, match="flash-attn takes fp16 or bf16 q, k, v of one dtype"):
        FlashAttnBackend(torch, "cpu")(x, x, x, torch.tensor([0, 4]), 4)


def test_flash_attn_4_without_its_dsl_names_the_install_line(monkeypatch):
    """FA4's wheel installs `flash_attn` as a namespace package: importing it works even when the
    CuTe DSL it needs is missing, so the failure comes from flash_attn.cute."""
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    with pytest.raises(PackctlError, match=r"flash_attn\.cute.*pip install 'packctl\[gpu\]'"):
        FlashAttnBackend(torch, "cuda")
