"""Join Parquet files with the same schema into one file, row groups copied byte for byte.

This is how several ranks write one shard: each encodes its own run of the shard's row groups
(a small Parquet file of its own), and the shard is their concatenation. No value is decoded
again: the column chunks are copied, and only the footer is rewritten, with every file offset
moved by where its part now starts:

    part 0:  PAR1 | rg0 rg1 | footer0 | len | PAR1
    part 1:  PAR1 | rg2     | footer1 | len | PAR1
    shard:   PAR1 | rg0 rg1 rg2 | footer (footer0's, row groups of both, offsets moved) | len | PAR1

The footer is Thrift compact protocol (parquet.thrift `FileMetaData`). It is read into a generic
tree of (field id, type, value) and written back field for field, so whatever this code does not
name (schema, key-value metadata, encodings...) is kept exactly. A part written with a page index
or encryption is refused: their offsets live outside the footer.
"""
from __future__ import annotations

import struct
from typing import Any

MAGIC = b"PAR1"

# Thrift compact protocol types
_TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(1, 13)

# parquet.thrift field ids
_FMD_NUM_ROWS, _FMD_ROW_GROUPS, _FMD_ENCRYPTION = 3, 4, 8
_RG_COLUMNS, _RG_FILE_OFFSET, _RG_ORDINAL = 1, 5, 7
_CC_FILE_OFFSET, _CC_META, _CC_OFFSET_INDEX, _CC_COLUMN_INDEX, _CC_CRYPTO = 2, 3, 4, 6, 8
_CMD_OFFSETS = (9, 10, 11, 14)  # data_page_offset, index_page_offset, dictionary_page_offset, bloom_filter_offset

Field = list  # [field id, compact type, value]; a struct is a list of fields


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def byte(self) -> int:
        b = self.data[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        shift = result = 0
        while True:
            b = self.byte()
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def value(self, ctype: int) -> Any:
        if ctype in (_TRUE, _FALSE):  # inside a list: one byte
            return self.byte() == _TRUE
        if ctype == _BYTE:
            return self.byte()
        if ctype in (_I16, _I32, _I64):
            return self.zigzag()
        if ctype == _DOUBLE:
            self.pos += 8
            return bytes(self.data[self.pos - 8:self.pos])
        if ctype == _BINARY:
            n = self.varint()
            self.pos += n
            return bytes(self.data[self.pos - n:self.pos])
        if ctype in (_LIST, _SET):
            head = self.byte()
            size, etype = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            return (etype, [self.value(etype) for _ in range(size)])
        if ctype == _MAP:
            size = self.varint()
            kv = self.byte() if size else 0
            return (kv, [(self.value(kv >> 4), self.value(kv & 0x0F)) for _ in range(size)])
        if ctype == _STRUCT:
            return self.struct()
        raise ValueError(f"unknown Thrift compact type {ctype}")

    def struct(self) -> list[Field]:
        fields: list[Field] = []
        last = 0
        while True:
            head = self.byte()
            if head == 0:
                return fields
            delta, ctype = head >> 4, head & 0x0F
            fid = last + delta if delta else self.zigzag()
            value = (ctype == _TRUE) if ctype in (_TRUE, _FALSE) else self.value(ctype)
            fields.append([fid, ctype, value])
            last = fid


class _Writer:
    def __init__(self) -> None:
        self.out = bytearray()

    def varint(self, n: int) -> None:
        while True:
            if n < 0x80:
                self.out.append(n)
                return
            self.out.append((n & 0x7F) | 0x80)
            n >>= 7

    def zigzag(self, n: int) -> None:
        self.varint((n << 1) ^ (n >> 63))

    def value(self, ctype: int, value: Any) -> None:
        if ctype in (_TRUE, _FALSE):
            self.out.append(_TRUE if value else _FALSE)
        elif ctype == _BYTE:
            self.out.append(value)
        elif ctype in (_I16, _I32, _I64):
            self.zigzag(value)
        elif ctype == _DOUBLE:
            self.out += value
        elif ctype == _BINARY:
            self.varint(len(value))
            self.out += value
        elif ctype in (_LIST, _SET):
            etype, items = value
            if len(items) < 15:
                self.out.append((len(items) << 4) | etype)
            else:
                self.out.append(0xF0 | etype)
                self.varint(len(items))
            for item in items:
                self.value(etype, item)
        elif ctype == _MAP:
            kv, items = value
            self.varint(len(items))
            if items:
                self.out.append(kv)
            for k, v in items:
                self.value(kv >> 4, k)
                self.value(kv & 0x0F, v)
        elif ctype == _STRUCT:
            self.struct(value)
        else:
            raise ValueError(f"unknown Thrift compact type {ctype}")

    def struct(self, fields: list[Field]) -> None:
        last = 0
        for fid, ctype, value in fields:
            wire = (_TRUE if value else _FALSE) if ctype in (_TRUE, _FALSE) else ctype
            if 0 < fid - last <= 15:
                self.out.append(((fid - last) << 4) | wire)
            else:
                self.out.append(wire)
                self.zigzag(fid)
            if ctype not in (_TRUE, _FALSE):
                self.value(ctype, value)
            last = fid
        self.out.append(0)


def _get(fields: list[Field], fid: int) -> Field | None:
    return next((f for f in fields if f[0] == fid), None)


def parse_footer(data) -> tuple[list[Field], int]:
    """(FileMetaData fields, offset where the footer starts) of a whole Parquet file (any
    bytes-like object: bytes, a memoryview, a pyarrow Buffer)."""
    data = memoryview(data).cast("B")
    if len(data) < 12 or data[:4] != MAGIC or data[-4:] != MAGIC:
        raise ValueError("not a Parquet file (no PAR1 magic)")
    length = struct.unpack("<I", data[-8:-4])[0]
    start = len(data) - 8 - length
    return _Reader(data[start:len(data) - 8]).struct(), start


def encode_footer(fields: list[Field]) -> bytes:
    writer = _Writer()
    writer.struct(fields)
    return bytes(writer.out)


def _move_row_group(rg: list[Field], shift: int, ordinal: int) -> None:
    for field in rg:
        if field[0] == _RG_FILE_OFFSET:
            field[2] += shift
        elif field[0] == _RG_ORDINAL:
            field[2] = ordinal
    for chunk in _get(rg, _RG_COLUMNS)[2][1]:
        for field in chunk:
            if field[0] in (_CC_OFFSET_INDEX, _CC_COLUMN_INDEX, _CC_CRYPTO):
                raise ValueError("cannot join Parquet files written with a page index or encryption")
            if field[0] == _CC_FILE_OFFSET and field[2]:  # Arrow writes 0 (the field is deprecated)
                field[2] += shift
        meta = _get(chunk, _CC_META)
        if meta is not None:
            for field in meta[2]:
                if field[0] in _CMD_OFFSETS:
                    field[2] += shift


def stitch(parts: list) -> bytes:
    """One Parquet file holding the row groups of `parts`, in order (same schema and metadata:
    the first part's footer is kept, with the row groups of all parts and the total row count)."""
    return b"".join(stitch_chunks(parts))


def stitch_chunks(parts: list) -> list:
    """`stitch` as the list of pieces to write one after the other (views into `parts`, no copy
    of the column chunks): `file.writelines(stitch_chunks(parts))` writes the joined file."""
    if not parts:
        raise ValueError("nothing to join")
    if len(parts) == 1:
        return [memoryview(parts[0]).cast("B")]
    bodies: list = []
    row_groups: list[list[Field]] = []
    head: list[Field] | None = None
    num_rows = 0
    position = len(MAGIC)
    for data in parts:
        data = memoryview(data).cast("B")
        footer, start = parse_footer(data)
        if _get(footer, _FMD_ENCRYPTION) is not None:
            raise ValueError("cannot join encrypted Parquet files")
        head = head if head is not None else footer
        shift = position - len(MAGIC)
        for rg in _get(footer, _FMD_ROW_GROUPS)[2][1]:
            _move_row_group(rg, shift, len(row_groups))
            row_groups.append(rg)
        num_rows += _get(footer, _FMD_NUM_ROWS)[2]
        bodies.append(data[len(MAGIC):start])
        position += start - len(MAGIC)
    _get(head, _FMD_NUM_ROWS)[2] = num_rows
    rg_field = _get(head, _FMD_ROW_GROUPS)
    rg_field[2] = (rg_field[2][0], row_groups)
    footer = encode_footer(head)
    return [MAGIC, *bodies, footer, struct.pack("<I", len(footer)), MAGIC]
