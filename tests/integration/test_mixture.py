"""`pack --source NAME=PATH:WEIGHT[:MAX_REPEAT]`: blends of sources of skewed sizes, their
realized shares overall and in every window within docs/mixtures.md's tolerance, caps refused
in one line, every row used as often as the draw says, and the same bytes for any rank count,
after a resume, and from a plan."""
from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from packctl import PackConfig, PackctlError, pack
from packctl.output.outdir import Faults
from packctl.pipeline import materialize_plan
from support.adversary import assert_clean_error, packctl
from support.data import write_table
from support.megatron import write_pair
from support.threadcomm import run_ranks

CAPACITY = 512


def _source(root: Path, name: str, rows: int, longest: int, seed: int, files: int = 2) -> Path:
    """`rows` rows of 1..longest tokens over `files` files; token values say their source and row."""
    rng = np.random.default_rng(seed)
    folder = root / name
    per = -(-rows // files)
    for f in range(files):
        lengths = rng.integers(1, longest + 1, min(per, rows - f * per))
        ids = [(seed * 1000 + rng.integers(0, 1000, n)).tolist() for n in lengths]
        write_table(folder / f"part-{f}.parquet", {"input_ids": pa.array(ids, pa.list_(pa.int32()))})
    return folder


@pytest.fixture(scope="module")
def blend(tmp_path_factory) -> dict[str, Path]:
    """Three sources of skewed sizes: many short rows, a few long ones, a middle one."""
    root = tmp_path_factory.mktemp("mixture")
    return {"web": _source(root, "web", 1500, 120, 1), "code": _source(root, "code", 90, 400, 2),
            "math": _source(root, "math", 300, 60, 3, files=1)}


def _flags(blend: dict[str, Path], weights: dict[str, str]) -> list[str]:
    return [a for name, w in weights.items() for a in ("--source", f"{name}={blend[name]}:{w}")]


def _config(blend, out: Path, weights: dict[str, float], caps: dict[str, float] | None = None, **options):
    sources = {name: {"path": str(blend[name]), "weight": w, **({"max-repeat": caps[name]} if caps and name in caps
                                                               else {})} for name, w in weights.items()}
    return PackConfig(output=str(out), sources=sources, **{"capacity": CAPACITY, **options})


def _packs(out: Path) -> pa.Table:
    return pq.read_table(out / "data", columns=["seq_lens", "sample_ids", "source_ids"])


def _digests(out: Path) -> dict[str, str]:
    return {p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*.parquet"))}


def _bound(longest: list[int], realized: np.ndarray, weights: np.ndarray, k: int, tokens: int) -> float:
    """docs/mixtures.md: a source's tokens in a window of `tokens` tokens are within its longest
    use, plus its realized share of every source's longest use, of its realized share; and the
    realized share within half a row of each source of the weight."""
    return longest[k] + realized[k] * sum(longest) + abs(realized[k] - weights[k]) * tokens + 1e-6


@pytest.mark.parametrize("order", ["input", "shuffle", "curriculum"])
def test_every_window_holds_the_blend_within_the_stated_tolerance(tmp_path, blend, order):
    weights = {"web": 0.5, "code": 0.3, "math": 0.2}
    result = pack(_config(blend, tmp_path / "out", weights, caps={"code": 3.0, "math": 3.0}, tokens=100_000,
                          window=100, shard_rows=1, order=order))
    mixture = result.metrics["mixture"]
    assert [s["name"] for s in mixture["sources"]] == list(weights)
    table = _packs(tmp_path / "out")
    lens = np.concatenate(table.column("seq_lens").to_numpy(zero_copy_only=False))
    source = np.concatenate(table.column("source_ids").to_numpy(zero_copy_only=False))
    w = np.array(list(weights.values()))
    given = np.bincount(source, weights=lens, minlength=3)
    assert abs(given.sum() - 100_000) <= 400
    realized = given / given.sum()
    assert np.allclose(realized, [s["realized"] for s in mixture["sources"]])
    longest = [120, 400, 60]
    assert np.all(np.abs(given - w * 100_000) <= np.array(longest) / 2 + 1e-6)  # each source within half a row
    # one pack a shard: the manifest's window_starts cut the packs into the planning windows
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    starts = manifest["window_starts"] + [table.num_rows]
    per_pack = np.array([len(x) for x in table.column("seq_lens").to_pylist()])
    pack_of = np.repeat(np.arange(table.num_rows), per_pack)
    worst = 0.0
    for a, b in zip(starts[:-1], starts[1:]):
        inside = (pack_of >= a) & (pack_of < b)
        tokens = int(lens[inside].sum())
        for k in range(3):
            mine = int(lens[inside & (source == k)].sum())
            assert abs(mine - w[k] * tokens) <= _bound(longest, realized, w, k, tokens), (order, a, k)
            worst = max(worst, abs(mine / tokens - w[k]))
    assert math.isclose(worst, mixture["worst_window_deviation"], rel_tol=1e-9, abs_tol=1e-12)


def test_every_row_is_used_as_often_as_the_report_says(tmp_path, blend):
    result = pack(_config(blend, tmp_path / "out", {"web": 0.4, "code": 0.6}, caps={"code": 2.5}, tokens=75_000,
                          order="shuffle"))
    table = _packs(tmp_path / "out")
    gids = np.concatenate(table.column("sample_ids").to_numpy(zero_copy_only=False))
    source = np.concatenate(table.column("source_ids").to_numpy(zero_copy_only=False))
    manifest = json.loads((tmp_path / "out" / "_manifest.json").read_text())
    for k, (entry, report) in enumerate(zip(manifest["sources"], result.metrics["mixture"]["sources"])):
        lo, hi = entry["gids"]
        mine = gids[source == k]
        assert ((mine >= lo) & (mine < hi)).all()
        counts = np.bincount(mine - lo, minlength=hi - lo)
        assert int(counts.sum()) == report["uses"] and int(np.count_nonzero(counts)) == report["rows_used"]
        assert counts.max() - counts.min() <= 1 and counts.max() == report["max_uses_of_a_row"]
    code = result.metrics["mixture"]["sources"][1]
    assert 2.0 <= code["repeats"] <= 2.5 and code["max_uses_of_a_row"] == 3
    assert manifest["sources"][1]["inputs"] == [2, 4] and len(manifest["sources"][1]["fingerprint"]) == 64
    report = packctl("verify", tmp_path / "out", "--source", blend["web"], "--source", blend["code"],
                     "--no-attention", "--json")
    assert report.code == 0, report.stdout + report.stderr
    conservation = json.loads(report.stdout)["checks"]["conservation"]
    assert [s["uses"] for s in conservation["sources"]] == [s["uses"] for s in result.metrics["mixture"]["sources"]]
    # the sources as pack takes them, NAME=PATH:WEIGHT[:CAP], name the same paths
    spelled = packctl("verify", tmp_path / "out", "--source", f"web={blend['web']}:0.4", "--source",
                      f"code={blend['code']}:0.6:2.5", "--no-attention")
    assert spelled.code == 0, spelled.stdout + spelled.stderr


def test_a_blend_over_a_cap_is_refused_in_one_line(tmp_path, blend):
    result = packctl("pack", *_flags(blend, {"web": "0.5", "code": "0.5:2"}), "--tokens", "100000", "-o",
                     tmp_path / "out", "--capacity", str(CAPACITY), "-q")
    line = assert_clean_error(result, 2, "--source code", "max-repeat 2", "raise its cap to")
    assert "passes over its" in line
    assert not (tmp_path / "out").exists()


def test_options_of_a_blend_without_sources_and_sources_with_input_are_refused(tmp_path, blend):
    assert_clean_error(packctl("pack", blend["web"], "-o", tmp_path / "o", "--tokens", "10"), 2, "--tokens",
                       "--source")
    assert_clean_error(packctl("pack", blend["web"], *_flags(blend, {"code": "1"}), "-o", tmp_path / "o"), 2,
                       "--source")
    assert_clean_error(packctl("pack", *_flags(blend, {"code": "1"}), "--source", f"web={blend['code']}:1", "-o",
                               tmp_path / "o"), 2, "--source web", "--source code")
    assert_clean_error(packctl("pack", "--source", "web", "-o", tmp_path / "o"), 2, "NAME=PATH:WEIGHT")


@pytest.mark.parametrize("ranks, balanced, epochs", [(2, False, 1), (3, False, 1), (2, True, 1), (3, True, 1),
                                                     (3, False, 2)])
def test_the_same_bytes_for_any_rank_count(tmp_path, blend, ranks, balanced, epochs):
    """A row drawn twice may land in two windows of one rank or of two: what a rank plans of a
    window (its split sequences, which balancing keeps in place) must not depend on the others."""
    options = dict(tokens=60_000, window=150, shard_rows=20, order="shuffle", too_long="split", capacity=256,
                   epochs=epochs, **(dict(dp_size=2, micro_batches=2) if balanced else {}))
    weights, caps = {"web": 0.4, "code": 0.5, "math": 0.1}, {"code": 2.0}
    one = pack(_config(blend, tmp_path / "one", weights, caps, **options))
    assert one.metrics["mixture"]["sources"][1]["max_uses_of_a_row"] == 2
    run_ranks(ranks, lambda comm: pack(_config(blend, tmp_path / "many", weights, caps, **options), comm=comm))
    assert _digests(tmp_path / "many") == _digests(tmp_path / "one")
    manifest = "_manifest.json" if epochs == 1 else "epoch-00001/_manifest.json"
    counts = [json.loads((tmp_path / out / manifest).read_text())["counts"] for out in ("one", "many")]
    assert counts[0] == counts[1]


def test_resume_after_a_failed_write_and_a_plan_give_the_same_bytes(tmp_path, blend):
    options = dict(tokens=40_000, window=150, shard_rows=10, order="shuffle")
    weights, caps = {"web": 0.6, "code": 0.4}, {"code": 2.0}
    pack(_config(blend, tmp_path / "ref", weights, caps, **options))
    with pytest.raises(PackctlError, match="No space left"):
        pack(_config(blend, tmp_path / "out", weights, caps, **options), faults=Faults(fail_write_after_shards=3))
    result = pack(_config(blend, tmp_path / "out", weights, caps, resume=True, **options))
    assert result.metrics["throughput"]["resumed_shards"] >= 3
    assert _digests(tmp_path / "out") == _digests(tmp_path / "ref")
    pack(_config(blend, tmp_path / "plan", weights, caps, plan_only=True, **options))
    materialize_plan(tmp_path / "plan", tmp_path / "made")
    assert _digests(tmp_path / "made") == _digests(tmp_path / "ref")


def test_every_epoch_draws_the_same_uses_in_its_own_order(tmp_path, blend):
    pack(_config(blend, tmp_path / "out", {"web": 0.5, "math": 0.5}, {"math": 3.0}, tokens=30_000, epochs=2,
                 order="shuffle"))
    epochs = [_packs(tmp_path / "out" / f"epoch-0000{e}") for e in range(2)]
    gids = [np.concatenate(t.column("sample_ids").to_numpy(zero_copy_only=False)) for t in epochs]
    assert not np.array_equal(gids[0], gids[1]) and np.array_equal(np.sort(gids[0]), np.sort(gids[1]))


def test_sequences_as_the_unit_and_a_toml_config(tmp_path, blend):
    toml = tmp_path / "blend.toml"
    toml.write_text(f'output = "{tmp_path / "out"}"\ncapacity = {CAPACITY}\nmix-unit = "sequences"\n'
                    f'epochs-of = "math"\n[sources.web]\npath = "{blend["web"]}"\nweight = 0.75\n'
                    f'[sources.math]\npath = "{blend["math"]}"\nweight = 0.25\n')
    result = packctl("pack", "--config", toml, "--json")
    assert result.code == 0, result.stderr
    mixture = json.loads(result.stdout)["metrics"]["mixture"]
    assert mixture["unit"] == "sequences" and [s["uses"] for s in mixture["sources"]] == [900, 300]


def test_a_megatron_blend_file(tmp_path):
    rng = np.random.default_rng(5)
    prefixes = []
    for name, count in (("web_text_document", 200), ("code_text_document", 40)):
        docs = [[rng.integers(0, 5000, int(rng.integers(1, 80))).tolist()] for _ in range(count)]
        write_pair(tmp_path / "data" / name, docs)
        prefixes.append(tmp_path / "data" / name)
    blend_file = tmp_path / "blend.txt"
    blend_file.write_text(f"0.8 {prefixes[0]}\n0.2 {prefixes[1]}\n")
    result = pack(PackConfig(output=str(tmp_path / "out"), blend=str(blend_file), capacity=CAPACITY,
                             order="shuffle"))
    names = [s["name"] for s in result.metrics["mixture"]["sources"]]
    assert names == ["web_text_document", "code_text_document"]
    assert all(abs(s["realized"] - s["weight"]) < 0.01 for s in result.metrics["mixture"]["sources"])


def test_without_sources_the_config_records_none_of_the_blend():
    recorded = PackConfig(inputs=["x"], output="o").to_dict()
    assert not {"sources", "blend", "mix_unit", "tokens", "epochs_of", "max_repeat"} & set(recorded)


def test_verify_finds_a_row_used_other_than_drawn(tmp_path, blend):
    pack(_config(blend, tmp_path / "out", {"web": 0.5, "code": 0.5}, caps={"code": 2.0}, tokens=30_000))
    manifest_path = tmp_path / "out" / "_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["config"]["seed"] = 7  # another seed draws other rows of the part-pass of code
    manifest_path.write_text(json.dumps(manifest))
    report = packctl("verify", tmp_path / "out", "--source", blend["web"], "--source", blend["code"],
                     "--no-attention", "--json")
    assert report.code == 1
    rules = {v["rule"] for v in json.loads(report.stdout)["violations"]}
    assert "source-uses" in rules, rules


def test_verify_names_the_first_token_a_blend_row_differs_at(tmp_path, blend):
    pack(_config(blend, tmp_path / "out", {"web": 0.5, "code": 0.5}, caps={"code": 2.0}, tokens=30_000))
    sources = {name: tmp_path / "sources" / name for name in ("web", "code")}
    for name, folder in sources.items():
        shutil.copytree(blend[name], folder)
    changed = pq.read_table(sources["web"] / "part-0.parquet")
    ids = [[t + 1 for t in row] for row in changed.column("input_ids").to_pylist()]
    write_table(sources["web"] / "part-0.parquet", {"input_ids": pa.array(ids, pa.list_(pa.int32()))})
    report = packctl("verify", tmp_path / "out", "--source", sources["web"], "--source", sources["code"],
                     "--no-attention", "--json")
    assert report.code == 1, report.stdout + report.stderr
    tokens = [v for v in json.loads(report.stdout)["violations"] if v["rule"] == "tokens"]
    assert len(tokens) == 5 and all("web" in v["message"] and "token 0 of the sequence" in v["message"]
                                    for v in tokens), tokens


def test_stats_shows_the_blend_before_packing_and_as_packed(tmp_path, blend):
    weights, caps = {"web": 0.5, "code": 0.3, "math": 0.2}, {"code": 3.0, "math": 3.0}
    options = dict(tokens=100_000, window=100, order="shuffle", dp_size=2, micro_batches=2)
    result = pack(_config(blend, tmp_path / "out", weights, caps, **options))
    packed = packctl("stats", tmp_path / "out", "--json")
    assert packed.code == 0, packed.stderr
    shown = json.loads(packed.stdout)["mixture"]
    recorded = result.metrics["mixture"]
    for got, want in zip(shown["sources"], recorded["sources"]):
        assert got["name"] == want["name"] and math.isclose(got["realized"], want["realized"])
        assert math.isclose(got["worst_window_deviation"], want["worst_window_deviation"])
        assert math.isclose(got["worst_step_deviation"], want["worst_step_deviation"])
    flags = [a for name, w in weights.items() for a in ("--source", f"{name}={blend[name]}:{w}:{caps.get(name, 1)}")]
    before = packctl("stats", *flags, "--tokens", "100000", "--window", "100", "--order", "shuffle", "--capacity",
                     str(CAPACITY), "--algorithm", "bfd", "--dp-size", "2", "--micro-batches", "2", "--json")
    assert before.code == 0, before.stderr
    planned = json.loads(before.stdout)
    assert [s["uses"] for s in planned["mixture"]["sources"]] == [s["uses"] for s in recorded["sources"]]
    assert planned["what_if"][0]["packs"] == result.metrics["packs"]
    text = packctl("stats", tmp_path / "out")
    assert "realized blend" in text.stdout and "math" in text.stdout


def test_a_blend_under_limits_keeps_every_limit_and_verify_checks_each_use(tmp_path):
    from packctl.sample import SampleSpec, write_sample

    for seed, name in enumerate(("photos", "charts")):
        write_sample(tmp_path / name, SampleSpec(sequences=300, seed=seed + 1, modality="image", max_length=900))
    sources = {"photos": {"path": str(tmp_path / "photos"), "weight": 0.4},
               "charts": {"path": str(tmp_path / "charts"), "weight": 0.6, "max_repeat": 3.0}}
    result = pack(PackConfig(output=str(tmp_path / "out"), sources=sources, capacity=2048, limits={"images": 4},
                             too_long="drop", epochs_of="photos", order="shuffle"))
    assert result.metrics["mixture"]["sources"][1]["max_uses_of_a_row"] >= 2
    sums = pq.read_table(tmp_path / "out" / "data", columns=["images_sum"]).column(0).to_numpy()
    assert sums.max() <= 4
    report = packctl("verify", tmp_path / "out", "--source", tmp_path / "photos", "--source", tmp_path / "charts",
                     "--no-attention", "--json")
    assert report.code == 0, report.stdout


def test_resume_after_a_kill_writes_the_uninterrupted_bytes(tmp_path, blend):
    from packctl.output.outdir import Faults
    from support.faulty_pack import run_forked
    import signal

    argv = ["pack", *_flags(blend, {"web": "0.5", "code": "0.5:2"}), "--tokens", "40000", "--capacity",
            str(CAPACITY), "--order", "shuffle", "--shard-rows", "10", "-q"]
    assert packctl(*argv, "-o", tmp_path / "ref").code == 0
    code, _, err = run_forked([*argv, "-o", str(tmp_path / "out")], Faults(kill_at="shard:journaled", kill_count=3))
    assert code == -signal.SIGKILL, err
    assert packctl(*argv, "-o", tmp_path / "out", "--resume").code == 0
    assert _digests(tmp_path / "out") == _digests(tmp_path / "ref")
