"""Every output column declared once (packctl/contract/schema.py): the table itself, what derives
from it (the writer's types and order, the reserved names), docs/format.md held against it, and no
column name spelled out anywhere else in packctl."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pyarrow as pa

import packctl
from packctl.contract.schema import (ALWAYS, COLUMN, COLUMNS, CU_ENTRY, PACK, PACK_COLUMNS, PACK_SCHEMA,
                                     RESERVED_COLUMNS, SEQUENCE, TOKEN, TOKEN_COLUMNS, column_order)
from packctl.contract.thd import build_pack_rows
from packctl.output.encode import rows_to_table
from support.paths import DOCS

PACKCTL = Path(packctl.__file__).resolve().parent


def test_the_table_declares_each_column_once_with_a_type_a_level_and_an_option():
    assert len(COLUMN) == len(COLUMNS) == len(RESERVED_COLUMNS) == 26
    assert set(RESERVED_COLUMNS) == {c.name for c in COLUMNS}
    for column in COLUMNS:
        assert column.value in ("int32", "int64", "float32", "float64"), column
        assert column.per in (TOKEN, SEQUENCE, CU_ENTRY, PACK), column
        assert column.written == ALWAYS or column.written.startswith("--"), column
        assert column.since is None or column.written == ALWAYS, column
        assert column.arrow_type == (pa.list_(column.value_type) if column.per != PACK else column.value_type)
    # format version 1's columns: what every shard holds, the fields of PackRows
    assert [f.name for f in PACK_SCHEMA] == list(PACK_COLUMNS) == [
        "input_ids", "labels", "position_ids", "seq_lens", "seq_lens_padded", "cu_seqlens", "cu_seqlens_padded",
        "sample_ids", "num_tokens"]
    assert str(PACK_SCHEMA.field("sample_ids").type) == "list<item: int64>"


def test_column_order_puts_kept_columns_between_the_per_pack_and_the_per_sequence_ones():
    assert column_order(["group_ids", "doc_id", "step", "input_ids", "seq_weights", "lr_scale", "a"]) == [
        "input_ids", "step", "lr_scale", "doc_id", "a", "seq_weights", "group_ids"]


def _rows():
    tokens = np.arange(1, 12, dtype=np.int32)
    return build_pack_rows(np.array([0, 2, 3]), np.array([5, 3, 3]), np.array([8, 8, 4]), np.array([7, 3, 4]),
                           tokens, tokens, np.array([16, 4]), pad_token_id=0)


def test_the_writer_gives_every_declared_column_its_type_whatever_it_is_handed():
    """Producers hand plain arrays (int64 steps, float64 scales, int32 ids, float32 weights from the
    input): the file's types come from the table alone."""
    per_pack = {"step": np.array([0, 1]), "dp_rank": np.array([1, 0], np.int8), "micro_batch": np.array([0, 0]),
                "lr_scale": np.array([1.0, 1 / 3]), "padded_len": np.array([8, 4]), "batch_size": np.array([2, 1]),
                "step_loss_tokens": np.array([9, 2], np.int32), "step_loss_sequences": np.array([2, 1], np.uint8)}
    per_sequence = {"group_ids": np.array([7, 3, 4], np.int32), "parent_segments": np.array([-1, -1, -1]),
                    "seq_weights": pa.chunked_array([[0.5, 1.5], [2.0]], pa.float32()),
                    "doc": pa.chunked_array([["x", "y", "z"]]), "source_ids": np.array([0, 1, 1], np.int64)}
    table = rows_to_table(_rows(), b"{}", per_pack, per_sequence)
    for field in table.schema:
        if field.name in COLUMN:
            assert field.type == COLUMN[field.name].arrow_type, field
        assert not field.nullable
    assert table.schema.field("doc").type == pa.list_(pa.string())  # a kept column as it is
    assert table.column_names == column_order(table.column_names)
    assert table.column_names[-5:] == ["doc", "seq_weights", "group_ids", "parent_segments", "source_ids"]
    assert set(COLUMN) - {"seq_starts"} <= set(table.column_names)  # seq_starts: a plan's alone
    assert table.column("lr_scale").to_pylist() == [1.0, np.float32(1 / 3)]
    assert table.column("seq_weights").to_pylist() == [[0.5, 1.5], [2.0]]
    assert table.column("group_ids").to_pylist() == [[7, 3], [4]]
    assert table.column("source_ids").to_pylist() == [[0, 1], [1]]
    assert table.column("seq_lengths").to_pylist() == table.column("seq_lens_padded").to_pylist() == [[8, 8], [4]]
    assert table.schema.metadata == {b"packctl": b"{}"}


def _format_table() -> dict[str, list[str]]:
    """The rows of the column table of docs/format.md ("One row per pack"), by column name."""
    section = (DOCS / "format.md").read_text().split("## One row per pack", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = re.fullmatch(r"`(\w+)`", cells[0])
        if line.startswith("|") and name:
            rows[name.group(1)] = [c.replace("`", "").replace("\\", "") for c in cells[1:]]
    return rows


def test_a_plan_table_holds_every_column_but_the_token_ones_and_seq_starts():
    packed = rows_to_table(_rows(), b"{}")
    plan = rows_to_table(_rows(), b"{}", None, {"seq_starts": np.array([0, 5, 0], np.int32)}, plan=True)
    assert plan.column_names == [n for n in packed.column_names if n not in TOKEN_COLUMNS] + ["seq_starts"]
    assert set(TOKEN_COLUMNS) == {"input_ids", "labels", "position_ids"}
    assert plan.schema.field("seq_starts").type == pa.list_(pa.int64())
    assert plan.column("seq_starts").to_pylist() == [[0, 5], [0]]
    for name in plan.column_names[:-1]:  # the loss columns too: counted from the labels all the same
        assert plan.column(name).equals(packed.column(name)), name


def test_docs_format_lists_every_column_as_the_table_declares_it():
    documented = _format_table()
    assert list(documented) == [c.name for c in COLUMNS], "docs/format.md lists the columns of COLUMNS, in order"
    for column in COLUMNS:
        type_text, per, written = documented[column.name][:3]
        assert (type_text, per, written) == (column.type_text, column.per, column.written), column.name


# String literals that spell an output column's name but mean something else, module by module
# (input columns share the output's default names).
NOT_COLUMNS = {
    "config.py": {"input_ids", "labels",  # the input's default tokens and labels columns
                  "step"},  # --group-scope step
    "enums.py": {"step"},  # --group-scope step
    "verify/groups.py": {"step"},  # --group-scope step
    "sample.py": {"input_ids", "labels"},  # the synthetic corpus' input columns
    "source/parquet.py": {"input_ids", "labels"},  # input columns
    "tokenize/options.py": {"input_ids", "labels"},  # the columns of a tokenized corpus, pack's input
    "source/kinds/__init__.py": {"input_ids"},  # the input's default tokens column
    "source/kinds/jsonl.py": {"input_ids", "labels"},  # input columns
    "source/megatron.py": {"input_ids"},  # the input's default tokens column
    "stats/whatif.py": {"input_ids",  # the input's default tokens column
                        "batch_size"},  # a metrics key
    "export/nemo.py": {"input_ids"},  # NeMo's own column
    "export/megatron.py": {"cu_seqlens"},  # the name of one of the export's indexed datasets
    "contract/manifest.py": {"lr_scale"},  # the manifest's field
    "plan/metrics.py": {"batch_size", "step"},  # metrics keys
    "plan/shapes.py": {"padded_len"},  # a metrics key
    "pipeline/plan.py": {"lr_scale"},  # a balance figure of the report
    "pipeline/report.py": {"lr_scale"},  # a metrics key
    "cli/render.py": {"batch_size", "padded_len"},  # metrics keys
}


def _literals(path: Path) -> list[tuple[int, str]]:
    """The string constants of a module that are not docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_no_column_name_is_spelled_out_outside_the_schema():
    found = []
    for path in sorted(PACKCTL.rglob("*.py")):
        module = path.relative_to(PACKCTL).as_posix()
        if module == "contract/schema.py":
            continue
        allowed = NOT_COLUMNS.get(module, set())
        found += [f"packctl/{module}:{line}: {value!r}" for line, value in _literals(path)
                  if value in COLUMN and value not in allowed]
    assert found == [], "use the name's constant of packctl.contract.schema"

