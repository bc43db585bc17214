"""The partial output directory's journal: which shards are finished, and what `--resume` keeps.

    .OUT.packctl-partial/
        run.json                       fingerprint of the run: config and inputs (path, size, mtime, footer digest)
        run.json.blocks                a digest of every input block as scan decoded it (`block_digest`)
        journal.jsonl                  one line per finished shard: {"shard", "rows", "tokens", "sha256"}
        journal.rank-00003.jsonl       the same, for the shards rank 3 finished (under MPI)

A shard is journaled (line appended and fsync'd) only after its file is complete under its final
name, so after a crash every journaled shard whose sha256 still matches can be kept.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from packctl.contract.manifest import ShardEntry, sha256_file
from packctl.errors import PackctlError

PARTIAL_SUFFIX = ".packctl-partial"
RUN_FILE = "run.json"
BLOCKS_FILE = RUN_FILE + ".blocks"  # left out of OUT with run.json (commit.drop_run_files)
JOURNAL = "journal.jsonl"


def partial_dir(out: Path) -> Path:
    """Where OUT is assembled: `.OUT.packctl-partial` beside it (the same name for every attempt, so
    `--resume` finds it)."""
    return out.parent / f".{out.name}{PARTIAL_SUFFIX}"


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def journal_line(info: ShardEntry) -> str:
    return json.dumps({"shard": info.path, "rows": info.rows, "tokens": info.tokens, "sha256": info.sha256}) + "\n"


def read_journal(tmp: Path) -> list[ShardEntry]:
    """Every shard the journals of `tmp` record (a torn last line, from a crash, is ignored)."""
    return journal_entries("\n".join(path.read_text() for path in sorted(tmp.glob("journal*.jsonl"))))


def journal_entries(text: str) -> list[ShardEntry]:
    """The shards journal lines record, in name order (a line that does not parse is left out: a
    torn last line from a crash; a shard journaled twice: its last line)."""
    shards: dict[str, ShardEntry] = {}
    for line in text.splitlines():
        try:
            entry = json.loads(line)
            info = ShardEntry(path=str(entry["shard"]), rows=int(entry["rows"]), tokens=int(entry["tokens"]),
                              sha256=str(entry["sha256"]))
        except (ValueError, KeyError, TypeError):
            continue
        shards[info.path] = info
    return [shards[name] for name in sorted(shards)]


def read_fingerprint(tmp: Path) -> dict | None:
    """The fingerprint in a partial directory's run.json; None when it is missing or unreadable."""
    try:
        fingerprint = json.loads((tmp / RUN_FILE).read_text())["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return fingerprint if isinstance(fingerprint, dict) else None


def write_block_digests(tmp: Path, digests: list[int]) -> None:
    """Record the digest of every input block (gid order) beside run.json, for `--resume`."""
    part = tmp / (BLOCKS_FILE + ".tmp")
    part.write_text(json.dumps({"blocks": digests}) + "\n")
    os.replace(part, tmp / BLOCKS_FILE)


def read_block_digests(tmp: Path) -> list[int] | None:
    """The block digests an earlier run recorded; None when it recorded none."""
    try:
        digests = json.loads((tmp / BLOCKS_FILE).read_text())["blocks"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return digests if isinstance(digests, list) else None


def differences(recorded: dict, fingerprint: dict, *, written_ns: int | None = None) -> list[str]:
    """What differs between what an earlier run recorded and this run's `fingerprint`
    (pipeline/run.py `run_fingerprint`): the option names, "inputs ...", and any other entry
    (format_version, packctl_version, layout).

    `recorded` is the fingerprint of run.json (compared whole), or a manifest (`written_ns`: the
    time it was written): a manifest records every option, of which those the fingerprint leaves
    out (where and how a run executes) are not compared, and its inputs without modification
    times, so an input modified after `written_ns` differs.

        differences({"config": {"seed": 1}, "inputs": []}, {"config": {"seed": 2}, "inputs": []})
        -> ["seed"]
    """
    manifest = written_ns is not None
    then, now = recorded.get("config"), fingerprint.get("config", {})
    then = then if isinstance(then, dict) else {}
    keys = set(now) | (set() if manifest else set(then))
    differ = sorted(k for k in keys if k != "resume" and then.get(k, _MISSING) != now.get(k, _MISSING))
    inputs_then, inputs_now = recorded.get("inputs"), fingerprint.get("inputs", [])
    if manifest and isinstance(inputs_then, list) and len(inputs_then) == len(inputs_now):
        same = all(isinstance(a, dict) and a == {k: b.get(k, _MISSING) for k in a}
                   for a, b in zip(inputs_then, inputs_now))
        if not same:
            differ.append("inputs (paths, rows or sizes)")
        elif any((entry.get("mtime_ns") or 0) > written_ns for entry in inputs_now):
            differ.append("inputs (modified after it was written)")
    elif inputs_then != inputs_now:
        differ = [k for k in differ if k != "inputs"]  # the files say more than the INPUT spelling
        differ.append(f"inputs ({_inputs_differ(inputs_then, inputs_now, now)})")
    for key in sorted((set(fingerprint) | (set() if manifest else set(recorded))) - {"config", "inputs"}):
        if (not manifest or key in recorded) and recorded.get(key, _MISSING) != fingerprint.get(key, _MISSING):
            differ.append(key)
    return differ


_MISSING = object()


# What a run fingerprints of each input (pipeline/run.py run_fingerprint), in words.
_INPUT_FIELDS = {"rows": "rows", "bytes": "size", "mtime_ns": "modification time", "footer": "Parquet footer"}


def _field_name(path: str, key: str, name: str, config: dict) -> str:
    """The `footer` digest is of what the input's kind fingerprints (`InputKind.footer_name`): a
    Megatron pair's .idx header and array ends, a JSONL file's bytes; the kind is the one the
    run's options (`config`: a tokenizer reads raw records) choose for the file."""
    from packctl.source.kinds import kind_of, options_of
    return kind_of(path, options_of(config)).footer_name if key == "footer" else name


def _inputs_differ(earlier: object, now: list[dict], config: dict) -> str:
    """Which input file differs from what the interrupted run read, named:
    'data/a.parquet changed since that run read it (Parquet footer, modification time)'."""
    before = {str(e.get("path")): e for e in earlier if isinstance(e, dict)} if isinstance(earlier, list) else {}
    paths = [str(e["path"]) for e in now]
    gone = [p for p in before if p not in paths]
    new = [p for p in paths if p not in before]
    more = (lambda names: f" (and {len(names) - 1} more)" if len(names) > 1 else "")
    if gone:
        return f"{gone[0]}{more(gone)} no longer among them" + (f"; {new[0]}{more(new)} is new" if new else "")
    if new:
        return f"{new[0]}{more(new)} is new"
    changed = [(p, [_field_name(p, key, name, config) for key, name in _INPUT_FIELDS.items()
                    if before[p].get(key) != e.get(key)]) for p, e in zip(paths, now)]
    changed = [(p, fields) for p, fields in changed if fields]
    if not changed:
        return "the same files in another order"
    path, fields = changed[0]
    return f"{path}{more(changed)} changed since that run read it ({', '.join(fields)})"


def inspect_partial(out: Path, fingerprint: dict, *, resume: bool) -> dict[str, ShardEntry] | None:
    """What an earlier, interrupted run left beside OUT, checked against this run.

    Returns the shards to keep (name -> ShardEntry: journaled, and the file still has its sha256),
    or None when there is nothing to resume (no partial directory, or one without finished shards).
    Raises when finished shards exist but `resume` is off, run.json cannot be read, or the
    fingerprint differs.
    """
    tmp = partial_dir(out)
    if not tmp.is_dir():
        return None
    journaled = read_journal(tmp)
    if not journaled:
        return None
    earlier = read_fingerprint(tmp)
    if earlier is None:
        raise PackctlError(f"{tmp}: holds {len(journaled)} finished shard(s) of an interrupted run but no readable "
                           f"{RUN_FILE}, so they cannot be resumed; delete that directory and run again")
    if not resume:
        raise PackctlError(
            f"{out}: an interrupted run left {len(journaled)} finished shard(s) in {tmp}; pass --resume to "
            "continue it, or delete that directory to start over")
    differ = differences(earlier, fingerprint)
    if differ:
        raise PackctlError(
            f"{out}: --resume refused: the interrupted run in {tmp} used different {', '.join(differ)}; "
            "run with the same options and inputs, or delete that directory and run without --resume")
    kept = {}
    for info in journaled:
        path = tmp / info.path
        if path.is_file() and sha256_file(path) == info.sha256:
            kept[info.path] = info
    return kept
