"""OUT on an object store (`pack -o s3://bucket/out`): a store has no rename, so a run writes its
shards under a prefix of its own and commits with one PUT of `_manifest.json`, which lists them.

    s3://bucket/out/
        _manifest.json                      the commit point, PUT last: lists runs/<run>/data/train-*.parquet
        _metrics.json                       the committed run's report (PUT just before the manifest)
        runs/20261128T071800Z-3f9a0c12/     one run: its id is its start time and 8 random hex digits
            run.json                        its fingerprint (as a local run.json); `replaces`: the run
                                            prefix its commit replaces (--overwrite)
            run.json.blocks                 the digest of every input block, for --resume
            journal.jsonl                   one line per finished shard {"shard", "rows", "tokens", "sha256"},
                                            PUT whole again after each shard (a PUT is never torn)
            data/train-00000.parquet        the shards, each one PUT (multipart when large)
            _metrics.json                   the run's report, beside its shards

The steps of a run, each finished before the next begins (names: output/commit.py):

    1. run.json PUT                                     "open:created"
    2. per shard: encoded in a local scratch directory, PUT under the run prefix
                                                        "store:shard-put"
       then the journal PUT with its line               "shard:journaled"
    3. the run's _metrics.json, then OUT/_metrics.json  "commit:metrics-written"
    4. run.json PUT again, naming the run it replaces   "store:replaces-noted"
    5. OUT/_manifest.json PUT: the output is the new run
                                                        "commit:manifest-written"
    6. the replaced run's objects deleted               "store:old-removed"

A reader opens `_manifest.json` and then only the objects it lists (contract/reader.py), so before
step 5 it sees the old output (or none), after it the new one; the objects a manifest lists are
never written again. Every run first finishes what a crash left (`settle`): a manifest whose run
names a replaced run still present has that run deleted (step 6), and an interrupted run's prefix
(its journal, no manifest naming it) is continued by `--resume`, which keeps each journaled shard
whose object still has its sha256 and writes the others under the same prefix.

There is no lock on a store: two runs at once write two run prefixes, and the manifest PUT last is
the output (docs/object-stores.md).
"""
from __future__ import annotations

import hashlib
import json
import re
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from packctl.contract.manifest import (DATA_DIR, EPOCHS, MANIFEST, METRICS, RUNS_DIR, ShardEntry, sha256_file,
                                       store_run_prefix)
from packctl.errors import PackctlError
from packctl.output.journal import BLOCKS_FILE, JOURNAL, RUN_FILE, differences, journal_entries, journal_line
from packctl.output.outdir import Faults, OutputDir, StagedShard
from packctl.output.resume import Outcome

_RUN_ID = re.compile(r"^\d{8}T\d{6}Z-[0-9a-f]{8}$")
_RUN_PREFIX = re.compile(rf"^{RUNS_DIR}/\d{{8}}T\d{{6}}Z-[0-9a-f]{{8}}/$")


def new_run_id() -> str:
    """A run prefix's name: its start time (UTC) and 8 random hex digits: `20261128T071800Z-3f9a0c12`."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(4)


def refuse_on_store(url: str, *, epochs: int, ranks: int) -> None:
    """What a store output does not take yet, refused in one line before anything is read."""
    if ranks > 1:
        raise PackctlError(f"{url}: an output on an object store is written by one process, not under mpiexec; "
                           "run without mpiexec, or write to a shared directory and copy it "
                           f"(`aws s3 sync DIR {url}`)", everywhere=True)
    if epochs > 1:
        raise PackctlError(f"{url}: --epochs {epochs} writes one output per epoch, which a store output does not "
                           "hold yet; pack each epoch to its own -o, or write locally and copy it "
                           f"(`aws s3 sync DIR {url}`)", everywhere=True)


# ---- the store's objects ------------------------------------------------------------------------


def _failed(url: str, exc: BaseException, doing: str) -> PackctlError:
    """A failed request as one line naming the URL (packctl.store `store_error`), where a denied
    write or delete names the permission it needs."""
    from packctl.store import store_error

    error = store_error(url, exc, doing)
    if doing in ("write", "delete") and "access denied" in str(error):
        bucket = url.split("://", 1)[1].split("/", 1)[0]
        needed = "s3:PutObject" if doing == "write" else "s3:DeleteObject"
        return PackctlError(f"{url}: cannot {doing}: access denied; grant these credentials {needed}, s3:GetObject "
                            f"and s3:ListBucket on {bucket}, or choose another -o", everywhere=True)
    return error


def _request(url: str, doing: str, fn, *args):
    try:
        return fn(*args)
    except PackctlError:
        raise
    except (OSError, ValueError) as exc:
        raise _failed(url, exc, doing) from None


def put_bytes(url: str, data: bytes) -> None:
    """One object written whole: it appears complete or not at all."""
    from packctl.store import filesystem_of

    filesystem, path = filesystem_of(url)

    def put() -> None:
        with filesystem.open_output_stream(path) as stream:
            stream.write(data)

    _request(url, "write", put)


def put_file(url: str, local: Path) -> None:
    """A local file's bytes as one object (pyarrow uploads a large one in parts, completed at close)."""
    from packctl.store import filesystem_of

    filesystem, path = filesystem_of(url)

    def put() -> None:
        with open(local, "rb") as fh, filesystem.open_output_stream(path) as stream:
            for block in iter(lambda: fh.read(8 << 20), b""):
                stream.write(block)

    _request(url, "write", put)


def get_bytes(url: str) -> bytes | None:
    """The bytes of the object at `url`; None when there is none."""
    from pyarrow import fs

    from packctl.store import filesystem_of

    filesystem, path = filesystem_of(url)
    info = _request(url, "read", filesystem.get_file_info, path)
    if info.type != fs.FileType.File:
        return None

    def get() -> bytes:
        with filesystem.open_input_stream(path) as stream:
            return stream.read()

    return _request(url, "read", get)


def get_json(url: str) -> dict | None:
    """The JSON object at `url`; None when there is none or it is not a JSON object."""
    data = get_bytes(url)
    try:
        value = json.loads(data) if data is not None else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def sha256_object(url: str) -> str | None:
    """Hex sha256 of an object's bytes, read in 8 MiB blocks; None when there is no object."""
    from pyarrow import fs

    from packctl.store import filesystem_of

    filesystem, path = filesystem_of(url)
    info = _request(url, "read", filesystem.get_file_info, path)
    if info.type != fs.FileType.File:
        return None

    def digest() -> str:
        hasher = hashlib.sha256()
        with filesystem.open_input_stream(path) as stream:
            for block in iter(lambda: stream.read(8 << 20), b""):
                hasher.update(block)
        return hasher.hexdigest()

    return _request(url, "read", digest)


def list_below(prefix: str) -> list[str]:
    """The URLs of the objects below `prefix`, sorted (nothing for a prefix with nothing below;
    the bucket is checked once, by `check_bucket`)."""
    from pyarrow import fs

    from packctl.store import filesystem_of

    filesystem, path = filesystem_of(prefix)
    selector = fs.FileSelector(path.rstrip("/"), recursive=True, allow_not_found=True)
    infos = _request(prefix, "list", filesystem.get_file_info, selector)
    return sorted(f"s3://{info.path}" for info in infos if info.type == fs.FileType.File)


def delete_below(prefix: str) -> int:
    """Delete every object below `prefix` (a run's: pyarrow deletes them in batches, and leaves no
    empty "folder" object behind); how many there were."""
    from packctl.store import filesystem_of

    objects = list_below(prefix)
    if objects:
        filesystem, path = filesystem_of(prefix)
        _request(prefix, "delete", filesystem.delete_dir, path)
    return len(objects)


def check_bucket(url: str) -> None:
    """Refuse an OUT whose bucket does not exist, in one line, before anything is written."""
    from pyarrow import fs

    from packctl.store import filesystem_of

    filesystem, path = filesystem_of(url)
    try:
        bucket = filesystem.get_file_info(path.split("/", 1)[0])
    except OSError:  # a HEAD of the bucket refused (no s3:ListBucket): the requests that follow say why
        return
    if bucket.type == fs.FileType.NotFound:
        raise _failed(url, OSError("NO_SUCH_BUCKET"), "write")


def delete_object(url: str) -> None:
    """Delete one object; one that is not there is left as it is."""
    from pyarrow import fs

    from packctl.store import filesystem_of

    filesystem, path = filesystem_of(url)
    if _request(url, "read", filesystem.get_file_info, path).type == fs.FileType.File:
        _request(url, "delete", filesystem.delete_file, path)


# ---- OUT on a store ------------------------------------------------------------------------------


@dataclass
class StoreOutput:
    """OUT as an `s3://` URL, and what the preflight (`settle`) found there: the run to write
    (`run_id`: a new one, or the interrupted one `--resume` continues) and the run its commit
    replaces. It stands where a local run has its `OutputLock`: a store has no lock to take.

        StoreOutput("s3://bucket/out").url("runs/X/data/train-00000.parquet")
        -> "s3://bucket/out/runs/X/data/train-00000.parquet"
    """

    root: str
    run_id: str = field(default_factory=new_run_id)
    # what the commit replaces (--overwrite): the committed run's prefix (relative to OUT), or the
    # objects listed by a manifest whose shards are not under a run prefix (a local OUT copied there)
    replaces: str | None = None
    replaced_objects: list[str] = field(default_factory=list)
    recorded_blocks: list[int] | None = None  # the block digests the continued run recorded

    def __post_init__(self) -> None:
        from packctl.store import normalize_url
        self.root = normalize_url(self.root)

    def __str__(self) -> str:
        return self.root

    def url(self, name: str = "") -> str:
        return f"{self.root}/{name}" if name else self.root

    @property
    def run_prefix(self) -> str:
        """The run's prefix relative to OUT: `runs/20261128T071800Z-3f9a0c12/`."""
        return f"{RUNS_DIR}/{self.run_id}/"

    def acquire(self) -> "StoreOutput":
        return self

    def release(self) -> None:
        pass

    def check_location(self, inputs: list[str]) -> None:
        """Refuse an OUT inside an input prefix (its shards would be read as input next time)
        and an INPUT inside OUT."""
        from packctl.store import is_store_url, normalize_url

        for spec in inputs:
            if not is_store_url(spec):
                continue
            given = normalize_url(spec.split("*", 1)[0].split("?", 1)[0].split("[", 1)[0])
            if (self.root + "/").startswith(given.rstrip("/") + "/") or given.startswith(self.root + "/"):
                raise PackctlError(f"{self.root}: inside the input {spec} (or holding it), so its shards would be "
                                   "read as input by the next run; choose an -o outside it", everywhere=True)

    def settle(self, fingerprint: dict, *, resume: bool, overwrite: bool) -> Outcome:
        """What this run does with what earlier runs left at OUT (output/resume.py's decision, on
        a store): finishes an interrupted overwrite, then returns `Outcome(complete=True)` for an
        OUT that is this run's output, or the shards of an interrupted run that `--resume` keeps
        (and this run's `run_id` becomes that run's). Raises where a local OUT is refused."""
        check_bucket(self.root)
        manifest = get_json(self.url(MANIFEST))
        if manifest is None and get_bytes(self.url(EPOCHS)) is not None:
            raise PackctlError(f"{self.root}: holds an output of --epochs ({EPOCHS}), which a store run neither "
                               "replaces nor resumes; delete it (`aws s3 rm --recursive "
                               f"{self.root}`) or choose another -o", everywhere=True)
        committed = committed_run(manifest) if manifest else None
        if committed is not None:
            self._finish_replacing(committed)
        if manifest is not None:
            keep = resume or not overwrite
            why = self._not_this_output(manifest, fingerprint) if keep else None
            if keep and why is None:
                return Outcome(complete=True)
            if not overwrite:
                detail = f" and is not the output of this command: {why}" if why and resume else ""
                raise PackctlError(f"{self.root}: already exists{detail}; pass --overwrite to replace it or choose "
                                   "another -o", everywhere=True)
            self.replaces = committed
            if committed is None:
                self.replaced_objects = sorted({str(s["path"]) for s in manifest.get("shards") or []
                                                if isinstance(s, dict) and isinstance(s.get("path"), str)})
        return Outcome(done=self._interrupted_run(fingerprint, committed, resume=resume))

    def committed_report(self) -> tuple[dict, list[ShardEntry]]:
        """The report and the shards of the output at OUT: its manifest's run's `_metrics.json`
        (OUT's own copy for an output whose shards are not under a run prefix)."""
        manifest = get_json(self.url(MANIFEST)) or {}
        committed = committed_run(manifest) or ""
        metrics = get_json(self.url(committed + METRICS)) or {}
        shards = [ShardEntry(path=str(s["path"]), rows=int(s["rows"]), tokens=int(s["tokens"]), sha256=str(s["sha256"]))
                  for s in manifest.get("shards", [])]
        return metrics, shards

    def _finish_replacing(self, committed: str) -> None:
        """Step 6 of a commit a crash interrupted: the committed run names the run it replaced;
        whatever is left of that run goes."""
        run = get_json(self.url(committed + RUN_FILE)) or {}
        replaced = run.get("replaces")
        if isinstance(replaced, str) and _RUN_PREFIX.match(replaced) and replaced != committed:
            delete_below(self.url(replaced.rstrip("/")))
        for name in run.get("replaced_objects") or []:  # an output whose shards were not under a run prefix
            if isinstance(name, str) and not name.startswith(committed):
                delete_object(self.url(name))

    def _not_this_output(self, manifest: dict, fingerprint: dict) -> str | None:
        """Why the manifest at OUT is not of the run of `fingerprint` (None: it is, and every shard
        it lists is there)."""
        from packctl.store import stat_object

        if not manifest or not isinstance(manifest.get("config"), dict) or "format_version" not in manifest:
            return "its _manifest.json is not one packctl pack writes"
        written = stat_object(self.url(MANIFEST))
        differ = differences(manifest, fingerprint, written_ns=written.mtime_ns if written else 0)
        if differ:
            return f"it differs in {', '.join(differ[:6])}"
        for shard in manifest.get("shards") or []:
            path = shard.get("path") if isinstance(shard, dict) else None
            if not isinstance(path, str) or stat_object(self.url(path)) is None:
                return f"its shard {path} is missing"
        return None

    def _newest_interrupted(self, committed: str | None) -> tuple[str, list[ShardEntry]] | None:
        """(run prefix, its journaled shards) of the interrupted run: the newest run prefix (run ids
        sort by their start time) with journaled shards that no manifest names; None if none."""
        below = len(self.url(RUNS_DIR)) + 1
        runs = sorted({url[below:].split("/", 1)[0] for url in list_below(self.url(RUNS_DIR))}, reverse=True)
        for run_id in runs:
            prefix = f"{RUNS_DIR}/{run_id}/"
            if prefix == committed or prefix == self.replaces or not _RUN_ID.match(run_id):
                continue
            journaled = read_journal_text((get_bytes(self.url(prefix + JOURNAL)) or b"").decode(errors="replace"))
            if journaled:
                return prefix, journaled
        return None

    def earlier_records(self) -> list[dict | None]:
        """What earlier runs recorded of their INPUT, newest first: the fingerprint in the
        interrupted run's run.json, then the committed manifest (`--resume` spells INPUT as they
        did: pipeline/run.py `_spelled_as_earlier_run`)."""
        manifest = get_json(self.url(MANIFEST))
        found = self._newest_interrupted(committed_run(manifest) if manifest else None)
        run = get_json(self.url(found[0] + RUN_FILE)) if found else None
        return [run.get("fingerprint") if run else None, manifest]

    def _interrupted_run(self, fingerprint: dict, committed: str | None, *, resume: bool
                         ) -> dict[str, ShardEntry] | None:
        """The shards an interrupted run (`_newest_interrupted`) finished that this run keeps
        (`--resume`), this run's `run_id` then being that run's; None when there is none."""
        found = self._newest_interrupted(committed)
        if found is None:
            return None
        prefix, journaled = found
        where = self.url(prefix.rstrip("/"))
        if not resume:
            raise PackctlError(f"{self.root}: an interrupted run left {len(journaled)} finished shard(s) under "
                               f"{where}; pass --resume to continue it, or delete that prefix "
                               f"(`aws s3 rm --recursive {where}`) to start over", everywhere=True)
        earlier = (get_json(self.url(prefix + RUN_FILE)) or {}).get("fingerprint")
        if not isinstance(earlier, dict):
            raise PackctlError(f"{where}: holds {len(journaled)} finished shard(s) of an interrupted run but no "
                               f"readable {RUN_FILE}, so they cannot be resumed; delete that prefix "
                               f"(`aws s3 rm --recursive {where}`) and run again", everywhere=True)
        differ = differences(earlier, fingerprint)
        if differ:
            raise PackctlError(f"{self.root}: --resume refused: the interrupted run under {where} used "
                               f"different {', '.join(differ)}; run with the same options and inputs, or delete "
                               f"that prefix (`aws s3 rm --recursive {where}`) and run without --resume",
                               everywhere=True)
        self.run_id = prefix.split("/")[1]
        blocks = get_json(self.url(prefix + BLOCKS_FILE)) or {}
        self.recorded_blocks = blocks.get("blocks") if isinstance(blocks.get("blocks"), list) else None
        return {info.path: info for info in journaled if sha256_object(self.url(prefix + info.path)) == info.sha256}


def committed_run(manifest: dict) -> str | None:
    """The run prefix whose shards a manifest lists (`runs/<id>/`); None for one that lists
    shards elsewhere (a local output copied to the store)."""
    return store_run_prefix(manifest.get("shards")) or None


def read_journal_text(text: str) -> list[ShardEntry]:
    """The shards a journal records, in name order (a line that does not parse is left out)."""
    return journal_entries(text)


class StoreOutputDir(OutputDir):
    """The output being written to a store: each shard is encoded into a local scratch directory
    (`tmp`, removed at the end), PUT under the run prefix and journaled there; `commit` PUTs the
    reports and then the manifest (module docstring)."""

    def __init__(self, target: StoreOutput, tmp: Path, *, done: dict[str, ShardEntry] | None = None,
                 faults: Faults | None = None, fingerprint: dict | None = None):
        super().__init__(Path(tmp), tmp, done=done, faults=faults)
        self.target = target
        self.fingerprint = fingerprint or {}
        self.entries: dict[str, ShardEntry] = dict(self.done)
        self.committed = False

    @classmethod
    def create(cls, target: StoreOutput, *, fingerprint: dict | None = None,
               done: dict[str, ShardEntry] | None = None, faults: Faults | None = None) -> "StoreOutputDir":
        """The scratch directory, and the run's run.json (and, resuming, its journal of the kept
        shards) PUT under its prefix."""
        tmp = Path(tempfile.mkdtemp(prefix="packctl-store-"))
        (tmp / DATA_DIR).mkdir()
        self = cls(target, tmp, done=done, faults=faults, fingerprint=fingerprint)
        try:
            self._put_run_file()
            if self.done:
                self._put_journal()
            self.reached("open:created")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return self

    @property
    def where(self) -> str:
        """Where the finished work of this run waits for `--resume`: its run prefix."""
        return self.target.url(self.target.run_prefix.rstrip("/"))

    def _put_run_file(self, **more) -> None:
        run = {"fingerprint": self.fingerprint, **more}
        put_bytes(self.target.url(self.target.run_prefix + RUN_FILE), (json.dumps(run, indent=2) + "\n").encode())

    def _put_journal(self) -> None:
        text = "".join(journal_line(self.entries[name]) for name in sorted(self.entries))
        put_bytes(self.target.url(self.target.run_prefix + JOURNAL), text.encode())

    def keep_block_digests(self, digests: list[int]) -> None:
        put_bytes(self.target.url(self.target.run_prefix + BLOCKS_FILE),
                  (json.dumps({"blocks": digests}) + "\n").encode())

    def stage_run_part(self, name: str, data) -> None:
        raise AssertionError("a store output is written by one process")

    def commit_shard(self, staged: StagedShard) -> ShardEntry:
        """The staged shard PUT under the run prefix, then journaled there; its local file removed."""
        part = self.tmp / f"{staged.name}.tmp"
        info = ShardEntry(path=staged.name, rows=staged.rows, tokens=staged.tokens, sha256=sha256_file(part))
        put_file(self.target.url(self.target.run_prefix + staged.name), part)
        part.unlink()
        self.reached("store:shard-put")
        with self._journal_lock:
            self.entries[info.path] = info
            self._put_journal()
            self.journaled += 1
            self.reached("shard:journaled")
        return info

    def finished_shards(self) -> int:
        return 0 if self.committed else len(self.entries)

    def is_complete(self) -> bool:
        return self.committed

    def commit(self, *, reports: list[tuple[str, dict]], manifests: list[tuple[str, dict]],
               shards: list[ShardEntry], overwrite: bool) -> None:
        """Steps 3-6 of the module docstring: the reports, the run it replaces noted, the manifest
        PUT (listing the run's shards by their paths under OUT), the replaced run deleted."""
        target, prefix = self.target, self.target.run_prefix
        for info in shards:
            if self.entries.get(info.path) != info:
                raise PackctlError(f"{self.where}/{info.path}: finished by this run but not in its journal; run the "
                                   "same command with --resume", everywhere=True)
        if len(manifests) != 1 or manifests[0][0] != MANIFEST:
            raise AssertionError("a store output has one manifest (--epochs is refused before)")
        for name, data in reports:
            put_bytes(target.url(prefix + name), (json.dumps(data, indent=2) + "\n").encode())
        for name, data in reports:
            put_bytes(target.url(name), (json.dumps(data, indent=2) + "\n").encode())
        self.reached("commit:metrics-written")
        manifest = dict(manifests[0][1])
        manifest["shards"] = [{**entry, "path": prefix + entry["path"]} for entry in manifest["shards"]]
        self._put_run_file(replaces=target.replaces, replaced_objects=target.replaced_objects)
        self.reached("store:replaces-noted")
        if not overwrite and get_bytes(target.url(MANIFEST)) is not None:
            raise PackctlError(f"{target.root}: appeared while this run wrote it (another run committed it); "
                               "pass --overwrite to replace it with this run's output", everywhere=True)
        put_bytes(target.url(MANIFEST), (json.dumps(manifest, indent=2) + "\n").encode())
        self.committed = True
        self.reached("commit:manifest-written")
        self.target._finish_replacing(prefix)
        self.reached("store:old-removed")
        self.close()

    def close(self) -> None:
        """Remove the local scratch directory (what is finished is on the store)."""
        shutil.rmtree(self.tmp, ignore_errors=True)

    def abort(self) -> None:
        """Remove the scratch directory, and the run prefix when it holds no finished shard."""
        self.close()
        if not self.entries and not self.committed:
            try:
                delete_below(self.where)
            except PackctlError:
                pass
