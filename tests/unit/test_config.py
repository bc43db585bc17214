from __future__ import annotations

import pytest

from packctl import PackConfig, PackctlError, load_config
from packctl.config import build_config, parse_bytes
from support.paths import DOCS


@pytest.mark.parametrize("cp, tp, sp, seq_multiple, align", [
    (1, 1, True, 1, 1), (2, 1, True, 1, 4), (2, 2, True, 1, 4), (1, 4, True, 1, 4), (1, 1, True, 64, 64),
    (4, 2, True, 24, 24), (1, 2, True, 3, 6), (2, 4, True, 1, 8), (2, 4, False, 1, 4), (1, 4, False, 1, 1),
    (4, 3, True, 1, 24), (4, 3, False, 1, 8), (3, 2, True, 1, 6), (8, 8, True, 1, 64),
])
def test_alignment(cp, tp, sp, seq_multiple, align):
    """lcm(seq_multiple, 2*cp if cp > 1, cp*tp if sequence parallel and tp > 1)."""
    cfg = PackConfig(cp_size=cp, tp_size=tp, sequence_parallel=sp, seq_multiple=seq_multiple)
    assert cfg.align == align
    assert align % cfg.seq_multiple == 0
    if cp > 1:  # Transformer Engine's THD split: 2*cp equal chunks of every sequence
        assert align % (2 * cp) == 0
    if sp and tp > 1:  # each CP rank's share of a sequence splits over the tp ranks
        assert (align // cp) % tp == 0


def test_plan_capacity_for_pad_to_multiple():
    cfg = PackConfig(capacity=4096, pad_to="multiple", pack_multiple=1000)
    assert cfg.plan_capacity == 4000
    assert PackConfig(capacity=4096).plan_capacity == 4096


def test_toml_keys_in_either_spelling_and_flags_win(tmp_path):
    path = tmp_path / "pack.toml"
    path.write_text('inputs = "data"\noutput = "o"\ncapacity = 2048\ntoo-long = "split"\n[other]\nx = 1\n')
    with pytest.raises(PackctlError, match="unknown key 'other'"):
        load_config(path)
    path.write_text('[pack]\ninputs = ["data"]\ncapacity = 2048\ntoo-long = "split"\ncp_size = 2\n')
    values = load_config(path)
    assert values == {"inputs": ["data"], "capacity": 2048, "too_long": "split", "cp_size": 2}
    cfg = build_config(values, output="o", capacity=None, cp_size=4)
    assert (cfg.capacity, cfg.too_long, cfg.cp_size, cfg.output) == (2048, "split", 4, "o")


@pytest.mark.parametrize("text, line", [
    ("capacty = 64\n", "pack.toml: unknown key 'capacty'; did you mean 'capacity'?"),
    ("too-lnog = 'split'\n", "pack.toml: unknown key 'too-lnog'; did you mean 'too-long'?"),
    ("[pack]\nmax_seqs_per_pack = 4\n", "pack.toml: unknown key 'max_seqs_per_pack'; did you mean 'max_seqs_per_bin'?"),
    ("limt = {images = 8}\n", "pack.toml: unknown key 'limt'; did you mean 'limit'?"),
])
def test_a_misspelled_toml_key_names_the_closest_known_key(tmp_path, text, line):
    path = tmp_path / "pack.toml"
    path.write_text(text)
    with pytest.raises(PackctlError) as caught:
        load_config(path)
    assert str(caught.value) == str(tmp_path / line)


def test_a_toml_key_near_no_known_key_lists_them_all(tmp_path):
    path = tmp_path / "pack.toml"
    path.write_text("xyzzy = 1\n")
    with pytest.raises(PackctlError, match="unknown key 'xyzzy'; known keys: add_bos, add_eos, algorithm, .*, window"):
        load_config(path)


def test_pack_order_in_toml_follows_order_unless_given(tmp_path):
    """`pack-order` (or `pack_order`) in a TOML file: auto resolves to shuffle under --order shuffle,
    else planner; a value is kept; a flag wins; a value outside the choices is refused in one line."""
    path = tmp_path / "pack.toml"
    path.write_text('[pack]\ninputs = ["data"]\norder = "curriculum"\npack-order = "longest"\n')
    values = load_config(path)
    assert values["pack_order"] == "longest"
    cfg = build_config(values, output="o")
    assert cfg.resolved_pack_order == "longest" and cfg.specs().windows.pack_order == "longest"
    assert cfg.to_dict()["pack_order"] == "longest"
    assert build_config(values, output="o", pack_order="mean").resolved_pack_order == "mean"
    path.write_text('[pack]\ninputs = ["data"]\norder = "shuffle"\n')
    cfg = build_config(load_config(path), output="o")
    assert cfg.pack_order == "auto" and cfg.resolved_pack_order == "shuffle"
    assert build_config({"inputs": ["data"]}, output="o").resolved_pack_order == "planner"
    assert "pack_order" not in build_config({"inputs": ["data"]}, output="o").to_dict()  # the bytes of before
    path.write_text('[pack]\ninputs = ["data"]\npack_order = "sideways"\n')
    with pytest.raises(PackctlError, match="pack.order") as err:
        build_config(load_config(path), output="o").validate()
    assert "\n" not in str(err.value)


def test_wrong_types_in_config_are_reported(tmp_path):
    with pytest.raises(PackctlError, match="--capacity '4096': must be a whole number"):
        PackConfig(inputs=["x"], output="o", capacity="4096").validate()


def test_parse_bytes():
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("512M") == 512 * 2**20
    assert parse_bytes("1e6") == 1_000_000
    with pytest.raises(PackctlError, match="--memory-budget 'lots'"):
        parse_bytes("lots")


def test_every_field_is_a_cli_flag():
    import dataclasses

    from typer.testing import CliRunner

    from packctl.cli import app

    help_text = CliRunner().invoke(app, ["pack", "--help"], env={"COLUMNS": "200"}).output
    for f in dataclasses.fields(PackConfig):
        flag = "--output" if f.name == "output" else f.metadata["flag"] or f"--{f.name.replace('_', '-')}"
        if f.name != "inputs":
            assert flag in help_text, flag


def test_every_option_is_documented_in_docs_cli_md_with_its_flag():
    import dataclasses

    table = (DOCS / "cli.md").read_text()
    for f in dataclasses.fields(PackConfig):
        if f.name not in ("inputs", "output"):
            assert f"| `{f.metadata['flag'] or '--' + f.name.replace('_', '-')}" in table, f.name


def _commands_and_flags() -> tuple[set[str], set[str]]:
    """The names of packctl's commands and every flag any of them (or packctl itself) takes."""
    import typer

    from packctl.cli import app

    root = typer.main.get_command(app)
    flags = {"--help"}
    for command in [root, *root.commands.values()]:
        for param in command.params:
            flags.update(o for o in [*param.opts, *param.secondary_opts] if o.startswith("--"))
    return set(root.commands), flags


def test_docs_cli_md_lists_every_command():
    commands, _ = _commands_and_flags()
    listing = (DOCS / "cli.md").read_text().split("```text\n", 1)[1].split("```", 1)[0]
    assert {line.split()[1] for line in listing.splitlines()} == commands


@pytest.mark.parametrize("doc", ["cli.md", "algorithms.md", "balancing.md", "format.md", "stats.md", "verify.md"])
def test_every_flag_the_docs_of_packctl_name_is_one_of_its_options(doc):
    """What docs/cli.md and the docs of its commands call a flag is one (lines about benchmarks/ name
    the benchmarks' own, and the section on the GPU script names its and pip's)."""
    import re

    _, flags = _commands_and_flags()
    text = (DOCS / doc).read_text()
    text = re.sub(r"(?ms)^## flash-attn on a GPU.*?(?=^## |\Z)", "", text)
    text = "\n".join(line for line in text.splitlines() if "benchmarks/" not in line and "pip install" not in line)
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", text))
    assert named - flags == set()


def test_help_choices_and_defaults_come_from_the_field():
    from packctl.config import choices_of, option_help

    assert choices_of("too_long") == ("error", "drop", "truncate", "split")
    assert option_help("too_long").startswith("error|drop|truncate|split: ")
    assert option_help("window").endswith("[default: 100,000]")
    assert option_help("equal_counts").endswith("[default: --equal-counts]")
    assert "[default" not in option_help("overwrite")
    with pytest.raises(PackctlError, match="--token-transfer 'rsync': choose one of auto, exchange, read"):
        PackConfig(inputs=["x"], output="o", token_transfer="rsync").validate()


def test_toml_config_is_read_where_the_standard_library_has_no_tomllib(tmp_path):
    """Python 3.10 has no tomllib: packctl imports and reads --config files with tomli."""
    import subprocess
    import sys

    pytest.importorskip("tomli")
    cfg = tmp_path / "pack.toml"
    cfg.write_text("capacity = 8\ntoo-long = 'split'\n")
    code = ("import sys; sys.modules['tomllib'] = None\n"
            "import packctl\nfrom packctl.config import load_config\nprint(load_config(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-c", code, str(cfg)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "'capacity': 8" in proc.stdout and "'too_long': 'split'" in proc.stdout


def test_sources_are_parsed_from_flags_and_checked_naming_the_source(tmp_path):
    from packctl.config import parse_sources
    from packctl.source.mixture import read_blend

    assert parse_sources(["web=a/b:c:0.5:2"]) == {"web": {"path": "a/b:c", "weight": 0.5, "max_repeat": 2.0}}
    for bad, words in ((["web"], "NAME=PATH:WEIGHT"), (["web=data:x"], "is not a number"),
                       (["web=a:1", "web=b:1"], "given twice")):
        with pytest.raises(PackctlError, match=words):
            parse_sources(bad)
    for table, words in (({"web": {"path": "a", "weight": 0}}, "weight 0 must be a number > 0"),
                         ({"web": {"path": "a", "weight": 1, "max-repeat": -1}}, "max-repeat -1"),
                         ({"web": {"weight": 1}}, "needs a path"),
                         ({"web": {"path": "a", "weight": 1, "cap": 2}}, "unknown key 'cap'")):
        with pytest.raises(PackctlError, match=words):
            PackConfig(output="o", sources=table).validate()
    with pytest.raises(PackctlError, match="--epochs-of code: not a source"):
        PackConfig(output="o", sources={"web": {"path": "a", "weight": 1}}, epochs_of="code").validate()
    blend = tmp_path / "blend.txt"
    blend.write_text("0.7 data/web_text_document\n0.3 more/web_text_document 1 data/code.idx\n")
    assert read_blend(str(blend)) == {"web_text_document": {"path": "data/web_text_document.idx", "weight": 0.7},
                                      "web_text_document-2": {"path": "more/web_text_document.idx", "weight": 0.3},
                                      "code": {"path": "data/code.idx", "weight": 1.0}}
    blend.write_text("0.7 data/web 0.3")
    with pytest.raises(PackctlError, match="pairs of 'weight prefix'"):
        read_blend(str(blend))
