"""--share-prefix: a group's common prefix stored once as a tree in one pack (docs/shared-prefix.md):
the layout of docs/format.md exactly, every input row rebuilt from its chain, packs within the
capacity, the same bytes on any number of ranks, and the combinations refused."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings, strategies as st

from packctl import PackConfig, PackctlError
from packctl.contract.tree import row_positions
from packctl.plan.align import round_up
from packctl.plan.prefix import expand_shared
from packctl.plan.windows import WindowOptions, plan_windows
from support.data import write_table
from support.profiles import examples
from support.runs import pack_to, packed_on_ranks

IGNORE = -100


def _packs(out):
    return [row for shard in sorted(out.glob("data/*.parquet")) for row in pq.read_table(shard).to_pylist()]


def _rebuilt(out) -> dict[int, tuple[list[int], list[int]]]:
    """Every input row as the output holds it: sample id -> (tokens, labels) of its chain."""
    rows: dict[int, tuple[list[int], list[int]]] = {}
    for pack in _packs(out):
        found = row_positions(pack["parent_segments"], pack["seq_lens"], pack["cu_seqlens_padded"],
                              pack["sample_ids"])
        ids, labels = np.array(pack["input_ids"]), np.array(pack["labels"])
        for k, segment in enumerate(found.segments.tolist()):
            gid = pack["sample_ids"][segment]
            assert gid not in rows, f"sample {gid} twice"
            where = found.row(k)
            rows[gid] = (ids[where].tolist(), labels[where].tolist())
    return rows


def _expected(tokens, labels):
    """An input row as a pack holds it: its first label -100."""
    return list(tokens), [IGNORE] + list(labels[1:])


def test_the_layout_of_two_rows_sharing_four_tokens_is_the_one_docs_format_draws(tmp_path):
    singles = [[50 + k, 60 + k, 70 + k] for k in range(5)]
    ids = singles + [[1, 2, 3, 4, 7, 8], [1, 2, 3, 4, 9]]
    labels = singles + [[IGNORE] * 4 + [7, 8], [IGNORE] * 4 + [9]]
    src = write_table(tmp_path / "in.parquet", {"input_ids": ids, "labels": labels, "g": [0, 1, 2, 3, 4, 5, 5]})
    _, out = pack_to(tmp_path, [src], capacity=8, group_column="g", share_prefix=True, algorithm="concat",
                     order="input")
    pack = next(p for p in _packs(out) if 5 in p["sample_ids"])
    assert pack["input_ids"] == [1, 2, 3, 4, 7, 8, 4, 9]
    assert pack["position_ids"] == [0, 1, 2, 3, 4, 5, 3, 4]
    assert pack["seq_lens"] == [3, 3, 2]
    assert pack["parent_segments"] == [-1, 0, 0]
    assert pack["sample_ids"] == [-1, 5, 6]
    assert pack["group_ids"] == [5, 5, 5]
    assert pack["labels"] == [IGNORE, IGNORE, IGNORE, IGNORE, 7, 8, IGNORE, 9]
    # the loss columns count rows: each row's targets on its segment, 0 on the prefix; attention
    # L^2 + 2 L c a segment of L tokens after c of its prefix: 9 + (9 + 18) + (4 + 12)
    assert pack["seq_loss_tokens"] == [0, 2, 1] and pack["num_loss_tokens"] == 3
    assert pack["sum_sq_seqlen"] == 52
    flat = next(p for p in _packs(out) if 0 in p["sample_ids"])
    assert flat["parent_segments"] == [-1] * len(flat["sample_ids"])  # the column is there, all -1
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["layout"]["tree"] is True and manifest["layout"]["share_prefix"] == {"prefix_column": None}
    assert manifest["config"]["share_prefix"] is True
    assert manifest["counts"]["tokens_shared"] == 3 and manifest["counts"]["tokens_packed"] == 15 + 8
    metrics = json.loads((out / "_metrics.json").read_text())["share_prefix"]
    assert metrics["groups_shared"] == 1 and metrics["tokens_saved"] == 3
    # rows of 6 and 5 tokens: 21 + 15 pairs flat; prefix 3 (6), branches 3 and 2 after it (9 + 6, 6 + 3)
    assert metrics["attention_flat"] - metrics["attention_tree"] == 36 - 30 == metrics["attention_saved"]


def _grouped_corpus(rng, groups: int, members, prompt_mean: float, response_mean: float, masked: bool):
    """Rows of groups sharing one prompt each (lognormal prompt and response lengths); prompts
    masked in the labels when `masked`. A few groups differ from the first token (nothing shared)."""
    ids, labels, group = [], [], []
    for g in range(groups):
        prompt = rng.integers(1, 5000, max(1, int(rng.lognormal(np.log(prompt_mean), 0.6)))).tolist()
        size = members() if callable(members) else members
        for _ in range(size):
            response = rng.integers(1, 5000, max(1, int(rng.lognormal(np.log(response_mean), 0.6)))).tolist()
            row = ([int(rng.integers(5000, 6000))] if g % 7 == 3 else []) + prompt + response
            ids.append(row)
            labels.append([IGNORE] * (len(row) - len(response)) + response if masked else row)
            group.append(g)
    return ids, labels, group


@pytest.mark.parametrize("members, masked, align", [(2, True, 1), (4, False, 1), (8, True, 8)])
def test_every_row_of_a_dpo_or_grpo_corpus_is_rebuilt_exactly_once_from_its_chain(tmp_path, members, masked, align):
    rng = np.random.default_rng(members)
    ids, labels, group = _grouped_corpus(rng, 40, members, 60, 30, masked)
    src = write_table(tmp_path / "in.parquet", {"input_ids": ids, "labels": labels, "g": group})
    pq.write_table(pq.read_table(src), src, row_group_size=7)  # groups straddle blocks
    capacity = 2048
    _, out = pack_to(tmp_path, [src], capacity=capacity, group_column="g", share_prefix=True, order="shuffle",
                     seq_multiple=align)
    rebuilt = _rebuilt(out)
    assert sorted(rebuilt) == list(range(len(ids)))
    for gid, (tokens, got_labels) in rebuilt.items():
        assert (tokens, got_labels) == _expected(ids[gid], labels[gid]), gid
    packs = _packs(out)
    assert max(len(p["input_ids"]) for p in packs) <= capacity
    counts = json.loads((out / "_manifest.json").read_text())["counts"]
    assert counts["tokens_in"] == counts["tokens_packed"] + counts["tokens_shared"] > counts["tokens_packed"]
    assert counts["sequences_split"] == 0


def test_with_a_prefix_column_a_group_shares_at_most_its_smallest_value(tmp_path):
    ids = [[1, 2, 3, 4, 7, 8], [1, 2, 3, 4, 9], [1, 2, 3, 5], [1, 2, 3, 6]]
    src = write_table(tmp_path / "in.parquet", {"input_ids": ids, "g": [0, 0, 2, 2], "prompt_length": [3, 2, 1, 9]})
    _, out = pack_to(tmp_path, [src], capacity=32, group_column="g", share_prefix=True,
                     prefix_column="prompt_length", algorithm="concat")
    (pack,) = _packs(out)
    # group 0: common prefix 4 but prompts of 3 and 2 tokens -> p 2; group 2: p 1 -> flat
    assert pack["seq_lens"] == [1, 5, 4, 4, 4] and pack["parent_segments"] == [-1, 0, 0, -1, -1]
    assert json.loads((out / "_manifest.json").read_text())["layout"]["share_prefix"] == {
        "prefix_column": "prompt_length"}


def test_curriculum_sorts_a_shared_group_by_its_stored_length(tmp_path):
    prompt = list(range(1, 21))
    ids = [[50 + k for k in range(15)], [70 + k for k in range(15)], prompt + [98], prompt + [99]]
    src = write_table(tmp_path / "in.parquet", {"input_ids": ids, "g": [0, 0, 2, 2]})
    _, out = pack_to(tmp_path, [src], capacity=128, group_column="g", share_prefix=True, order="curriculum",
                     algorithm="concat")
    (pack,) = _packs(out)
    # group 2 stores 19 + 2 + 2 = 23 tokens (42 as rows), group 0 stores 30: ascending, group 2 first
    assert pack["sample_ids"] == [-1, 2, 3, 0, 1]


@pytest.mark.parametrize("order", ["shuffle", "curriculum"])
def test_one_and_three_ranks_write_the_same_bytes(tmp_path, order):
    rng = np.random.default_rng(3)
    ids, labels, group = _grouped_corpus(rng, 60, lambda: int(rng.integers(1, 6)), 40, 20, True)
    src = write_table(tmp_path / "in.parquet", {"input_ids": ids, "labels": labels, "g": group})
    pq.write_table(pq.read_table(src), src, row_group_size=5)
    out = packed_on_ranks(tmp_path, 3, inputs=[str(src)], capacity=512, group_column="g", share_prefix=True,
                          order=order, window=9, dp_size=2, micro_batches=2)
    assert sorted(_rebuilt(out)) == list(range(len(ids)))
    from packctl.verify import VerifyOptions, verify
    report = verify(out, VerifyOptions(attention=False))  # loss-tokens, attn-cost, step-loss recounted per row
    assert report.violations == []


@pytest.mark.parametrize("options, says", [
    (dict(share_prefix=True), "--share-prefix needs --group-column"),
    (dict(group_column="g", prefix_column="p"), "--prefix-column p needs --share-prefix"),
    (dict(group_column="g", share_prefix=True, cp_size=2), "--cp-size cannot be combined with --share-prefix"),
    (dict(group_column="g", share_prefix=True, plan_only=True), "--plan-only cannot be combined"),
    (dict(group_column="g", share_prefix=True, limits={"images": 2}), "--limit cannot be combined"),
    (dict(group_column="g", share_prefix=True, keep_columns=["doc"]), "--keep-columns cannot be combined"),
    (dict(group_column="g", share_prefix=True, weight_column="w"), "--weight-column cannot be combined"),
    (dict(group_column="g", share_prefix=True, prefix_column="g"), "--prefix-column 'g': name an input column"),
    (dict(group_column="g", share_prefix=True, group_scope="step", dp_size=2, micro_batches=2),
     "--group-scope step cannot be combined with --share-prefix"),
])
def test_combinations_that_cannot_hold_a_tree_are_refused_in_one_line(options, says):
    with pytest.raises(PackctlError) as caught:
        PackConfig(inputs=["in"], output="out", **options).validate()
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_a_prefix_column_with_a_negative_value_names_its_row(tmp_path):
    src = write_table(tmp_path / "in.parquet", {"input_ids": [[1, 2], [1, 3]], "g": [0, 0], "p": [1, -2]})
    with pytest.raises(PackctlError, match=r"in.parquet row 1 column 'p': -2 is negative"):
        pack_to(tmp_path, [src], capacity=16, group_column="g", share_prefix=True, prefix_column="p")


@settings(max_examples=examples(120), deadline=None)
@given(data=st.data(), algorithm=st.sampled_from(["concat", "ffd", "bfd", "mffd", "ffs", "pool"]),
       align=st.sampled_from([1, 4]), window=st.integers(1, 9))
def test_planning_stores_each_shared_group_once_and_keeps_every_pack_within_its_capacity(data, algorithm, align,
                                                                                       window):
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=30))
    capacity = 96
    lengths, shared = [], []
    for size in sizes:
        rows = data.draw(st.lists(st.integers(1, 20), min_size=size, max_size=size))
        common = data.draw(st.integers(0, min(rows)))
        lengths += rows
        shared += [common - 1 if size > 1 and common >= 2 else 0] * size
    lengths, shared = np.array(lengths, np.int64), np.array(shared, np.int64)
    new_group = np.concatenate([[True] + [False] * (s - 1) for s in sizes])
    gids = np.arange(len(lengths))
    plan = plan_windows(gids, lengths, WindowOptions(capacity=capacity, align=align, algorithm=algorithm,
                                                     too_long="error", window=window),
                        new_group=new_group, shared=shared)
    assert (plan.loads() <= capacity).all()
    # the planned segments are exactly those of `expand_shared`, each group whole in one pack, in order
    rows, starts, seg_lens, _ = expand_shared(lengths, shared, new_group)
    expected = sorted(zip(rows.tolist(), starts.tolist(), seg_lens.tolist()))
    assert sorted(zip(plan.piece_gid.tolist(), plan.piece_start.tolist(), plan.piece_len.tolist())) == expected
    assert (plan.piece_padded == round_up(plan.piece_len, align)).all() or plan.num_bins == 0
    pack_of = np.repeat(np.arange(plan.num_bins), np.diff(plan.bin_offsets))
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for lo, size in zip(first.tolist(), sizes):
        where = np.flatnonzero((plan.piece_gid >= lo) & (plan.piece_gid < lo + size))
        assert len(set(pack_of[where].tolist())) == 1 and (np.diff(where) == 1).all()
        assert plan.piece_gid[where].tolist() == sorted(plan.piece_gid[where].tolist())
    stored = round_up(lengths - shared, align).sum() + round_up(shared[new_group], align).sum()
    assert plan.loads().sum() == stored


# ------------------------------------------------------------------------------------------ verify


def _verified_tree(tmp_path):
    """A packed corpus of pairs and rollouts sharing prompts, and its source."""
    rng = np.random.default_rng(11)
    ids, labels, group = _grouped_corpus(rng, 12, lambda: int(rng.integers(2, 5)), 12, 6, True)
    src = write_table(tmp_path / "in.parquet", {"input_ids": ids, "labels": labels, "g": group})
    _, out = pack_to(tmp_path, [src], capacity=256, group_column="g", share_prefix=True, seq_multiple=2)
    return src, out


def _tamper(out, change) -> None:
    """`change(pack)` edits the first pack holding a shared group (a dict of its columns); the
    shard's checksum is written again, so only the change is left to find."""
    from packctl.contract.manifest import sha256_file
    manifest = json.loads((out / "_manifest.json").read_text())
    for entry in manifest["shards"]:
        path = out / entry["path"]
        table = pq.read_table(path)
        packs = table.to_pylist()
        hit = next((p for p in packs if max(p["parent_segments"]) >= 0), None)
        if hit is None:
            continue
        change(hit)
        pq.write_table(pa.Table.from_pylist(packs, schema=table.schema), path)
        entry["sha256"] = sha256_file(path)
        (out / "_manifest.json").write_text(json.dumps(manifest, indent=2))
        return
    raise AssertionError("no shared group to tamper with")


@pytest.mark.torch  # verify's attention check runs torch's sdpa
def test_verify_accepts_a_tree_output_with_its_source_and_attention(tmp_path):
    from packctl.verify import VerifyOptions, verify
    src, out = _verified_tree(tmp_path)
    report = verify(out, VerifyOptions(source=[str(src)], sample=4, backend="sdpa", device="cpu"))
    assert report.violations == []
    assert report.checks["attention"].status == "ok"


def _second_branch_to_first(pack):
    parents = pack["parent_segments"]
    children = [k for k, p in enumerate(parents) if p >= 0]
    parents[children[1]] = children[0]  # the second branch continues its sibling instead of the prefix


def _prefix_token_changed(pack):
    prefix = pack["sample_ids"].index(-1)
    pack["input_ids"][pack["cu_seqlens_padded"][prefix]] += 1  # every row of the group changes


def _prefix_counted_as_a_sequence(pack):
    prefix = pack["sample_ids"].index(-1)
    pack["seq_loss_tokens"][prefix] = 1  # a prefix is no row: its targets count in its rows, never on it
    pack["num_loss_tokens"] += 1


@pytest.mark.torch  # verify's attention check runs torch's sdpa
@pytest.mark.parametrize("change, rules", [
    (_second_branch_to_first, {"tree-prefix", "position-ids", "attention-equivalence"}),
    (_prefix_token_changed, {"tokens"}),
    (_prefix_counted_as_a_sequence, {"loss-tokens"}),
])
def test_a_tampered_tree_fails_with_a_named_rule(tmp_path, change, rules):
    from packctl.verify import VerifyOptions, verify
    src, out = _verified_tree(tmp_path)
    _tamper(out, change)
    report = verify(out, VerifyOptions(source=[str(src)], sample=64, backend="sdpa", device="cpu"))
    assert rules <= {v.rule for v in report.violations}, [str(v) for v in report.violations]


# ------------------------------------------------------------------------------------------ stats


def test_stats_of_the_output_and_the_what_if_report_what_pack_saved(tmp_path):
    from packctl.stats import input_stats, stats
    rng = np.random.default_rng(5)
    ids, labels, group = _grouped_corpus(rng, 30, 4, 80, 20, True)
    src = write_table(tmp_path / "in.parquet", {"input_ids": ids, "labels": labels, "g": group})
    options = dict(group_column="g", share_prefix=True, algorithm="bfd")
    _, out = pack_to(tmp_path, [src], capacity=2048, **options)
    metrics = json.loads((out / "_metrics.json").read_text())
    written = metrics["share_prefix"]
    assert written["groups_shared"] == sum(1 for g in range(30) if g % 7 != 3)
    assert written["tokens_saved"] > 0 and 0 < written["attention_saved_fraction"] < 1
    recounted = stats([str(out)])
    assert recounted["share_prefix"] == written
    assert recounted["padded_batching"] == metrics["padded_batching"]  # each prefix where pack puts it
    (row,) = input_stats([str(src)], [2048], PackConfig(**options), algorithms=["bfd"])["what_if"]
    assert row["share_prefix"] == written
    assert row["counts"]["tokens_shared"] == written["tokens_saved"]


@settings(max_examples=examples(60, default=8), deadline=None)
@given(data=st.data(), algorithm=st.sampled_from(["concat", "bfd", "ffs", "pool"]), align=st.sampled_from([1, 2]),
       rows_per_block=st.integers(1, 6))
def test_any_groups_and_prefixes_are_rebuilt_within_capacity_and_alike_on_two_ranks(tmp_path_factory, data, algorithm,
                                                                                      align, rows_per_block):
    """Random groups (1 to 5 rows) whose rows share random prefixes (some none, some whole rows),
    labels masked on a random part: every row rebuilt exactly once, no pack over the capacity, and
    the bytes of one rank on two."""
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=12))
    ids, labels, group = [], [], []
    for g, size in enumerate(sizes):
        prompt = data.draw(st.lists(st.integers(1, 9), min_size=0, max_size=8))
        for _ in range(size):
            tail = data.draw(st.lists(st.integers(1, 9), min_size=0 if prompt else 1, max_size=6))
            row = prompt + tail
            masked = data.draw(st.integers(0, len(row)))
            ids.append(row)
            labels.append([IGNORE] * masked + row[masked:])
            group.append(g)
    tmp_path = tmp_path_factory.mktemp("random")
    src = write_table(tmp_path / "in.parquet", {"input_ids": ids, "labels": labels, "g": group})
    pq.write_table(pq.read_table(src), src, row_group_size=rows_per_block)
    capacity = 128
    out = packed_on_ranks(tmp_path, 2, inputs=[str(src)], capacity=capacity, group_column="g", share_prefix=True,
                          algorithm=algorithm, seq_multiple=align, order="shuffle", window=3)
    rebuilt = _rebuilt(out)
    assert sorted(rebuilt) == list(range(len(ids)))
    for gid, got in rebuilt.items():
        assert got == _expected(ids[gid], labels[gid]), gid
    assert max(len(p["input_ids"]) for p in _packs(out)) <= capacity


def test_export_refuses_a_tree_output_in_one_line(tmp_path):
    from packctl.export import export
    src = write_table(tmp_path / "in.parquet", {"input_ids": [[1, 2, 3, 4], [1, 2, 3, 5]], "g": [0, 0]})
    _, out = pack_to(tmp_path, [src], capacity=16, group_column="g", share_prefix=True)
    with pytest.raises(PackctlError, match="packed with --share-prefix .* flat sequences only"):
        export(out, tmp_path / "nemo", "nemo")


@pytest.mark.torch  # verify's attention check runs torch's sdpa
def test_preference_pairs_from_packctl_tokenize_share_their_prompt_up_to_prompt_length(tmp_path):
    """`packctl tokenize` of preference records writes two rows a record and each row's
    `prompt_length`: packed with --prefix-column prompt_length each pair shares its prompt, every
    branch starting at the prompt's last token, and verify passes with the source."""
    from support.adversary import packctl
    from support.tokenizers import tokenizer_dir
    from packctl.verify import VerifyOptions, verify

    records = [{"prompt": [{"role": "user", "content": f"is {i} even? answer in one word please"}],
                "chosen": [{"role": "assistant", "content": "yes" if i % 2 == 0 else "no"}],
                "rejected": [{"role": "assistant", "content": "no" if i % 2 == 0 else "yes"}]} for i in range(20)]
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "pairs.json").write_text(json.dumps(records))
    tok = tokenizer_dir(tmp_path / "tok")
    result = packctl("tokenize", tmp_path / "raw", "-o", tmp_path / "tokenized", "--tokenizer", tok, "--workers", "1")
    assert result.code == 0, result.stderr
    source = pq.read_table(tmp_path / "tokenized" / "data").to_pydict()
    # the output of tokenize holds a manifest, yet it is an input: stats plans it, as pack reads it
    what_if = packctl("stats", tmp_path / "tokenized", "--capacity", "512", "--group-column", "record_id",
                      "--share-prefix", "--prefix-column", "prompt_length")
    assert what_if.code == 0 and "sharing prefixes saves" in what_if.stdout, what_if.stdout + what_if.stderr
    _, out = pack_to(tmp_path, [tmp_path / "tokenized"], capacity=512, group_column="record_id", share_prefix=True,
                     prefix_column="prompt_length")
    counts = json.loads((out / "_manifest.json").read_text())["counts"]
    assert counts["tokens_shared"] == sum(n - 1 for n in source["prompt_length"][::2])
    for pack in _packs(out):
        for k, parent in enumerate(pack["parent_segments"]):
            if parent >= 0:
                gid = pack["sample_ids"][k]
                assert pack["seq_lens"][parent] == source["prompt_length"][gid] - 1
    report = verify(out, VerifyOptions(source=[str(tmp_path / "tokenized")], sample=4, backend="sdpa", device="cpu"))
    assert report.violations == []
