"""Real-text benchmark corpora, tokenized, cached under /tmp/packctl-bench/.

    python benchmarks/realtext.py [code prose chat] [--dir /tmp/packctl-bench] [--rebuild]

Three corpora made from text already on the machine, one file (or one pair) = one document,
nothing concatenated:

| corpus | documents | columns |
|---|---|---|
| `code` | Python source files of the interpreter's stdlib, its site-packages and the other Python trees installed here (/usr/lib/python3, the Google Cloud SDK's generated clients when present): a long tail up to 1M+ tokens a file | `input_ids` |
| `prose` | English man pages (roff markup stripped in Python, not rendered by groff: 60 ms a page would take minutes) and the .txt/.md/.rst documents under /usr/share/doc and the Python trees | `input_ids` |
| `chat` | SFT-like pairs from real text: a Python function's docstring -> the function, a man page's section title -> the section; a fixed template prefix, the prompt masked with -100 | `input_ids`, `labels` |

A chat document, as tokens (labels -100 up to and including `[/INST]`):

    <s> [SYSTEM_PROMPT] You are ... [/SYSTEM_PROMPT] [INST] Write a Python function ... [/INST] def f(...): ... </s>

Tokenizer: Mistral's Tekken BPE (tekken_240911.json, 131,072 ids, the tokenizer of Mistral NeMo),
the file shipped inside the `mistral-common` wheel, encoded with `tiktoken` from that local file
(nothing is downloaded; `pip install -e '.[bench]'`). Ids go above 65,535, as with any modern
vocabulary.

Deterministic: files are chosen and ordered by hashes of their contents, so the same machine
gives the same corpus; the cache stamp records how many source files and bytes were seen, so a
machine with other packages installed builds (and labels) its own.
"""
from __future__ import annotations

import argparse
import ast
import base64
import gzip
import hashlib
import importlib.util
import json
import os
import re
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

BUILDER_VERSION = 1
TOKENIZER_FILE = "tekken_240911.json"
CORPORA = ("code", "prose", "chat")
# Bytes of source text each corpus is built from (Tekken: about 4.2 bytes a token on code).
DEFAULT_BYTES = {"code": 256 << 20, "prose": 160 << 20, "chat": 128 << 20}
SHARDS = 8
ROW_GROUP_ROWS = 4096
IGNORE_INDEX = -100
SYSTEM_PROMPT = "You are a helpful assistant for programmers and system administrators. Answer precisely."


# ---------------------------------------------------------------------------------------------
# tokenizer

def tokenizer_path() -> Path:
    spec = importlib.util.find_spec("mistral_common")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("benchmarks/realtext.py needs the tokenizer file of mistral-common: pip install -e '.[bench]'")
    return Path(spec.submodule_search_locations[0]) / "data" / TOKENIZER_FILE


class Tekken:
    """Tekken BPE from the file inside mistral-common: `encode(texts) -> list of int32 arrays`.

    Ids as `mistral_common`'s `Tekkenizer.encode(text, bos=False, eos=False)` gives them (ordinary
    tokens shifted by the 1,000 special ids); checked against it on load.
    """

    def __init__(self) -> None:
        import tiktoken
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer

        path = tokenizer_path()
        model = json.loads(path.read_text(encoding="utf-8"))
        config = model["config"]
        self.num_special = config["default_num_special_tokens"]
        inner = config["default_vocab_size"] - self.num_special
        ranks = {base64.b64decode(v["token_bytes"]): v["rank"] for v in model["vocab"][:inner]}
        self.encoding = tiktoken.Encoding(name=path.stem, pat_str=config["pattern"], mergeable_ranks=ranks,
                                          special_tokens={})
        reference = Tekkenizer.from_file(path)
        self.bos, self.eos = reference.bos_id, reference.eos_id
        self.begin_inst, self.end_inst = reference.get_special_token("[INST]"), reference.get_special_token("[/INST]")
        self.begin_system = reference.get_special_token("[SYSTEM_PROMPT]")
        self.end_system = reference.get_special_token("[/SYSTEM_PROMPT]")
        sample = 'def f(x):\n    """Return x + 1."""\n    return x + 1  # ünïcode\n\n\tDone.'
        assert self.encode([sample])[0].tolist() == reference.encode(sample, bos=False, eos=False)
        self.vocab_size = config["default_vocab_size"]

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        batches = self.encoding.encode_ordinary_batch(texts, num_threads=os.cpu_count() or 1)
        return [np.asarray(ids, dtype=np.int32) + np.int32(self.num_special) for ids in batches]


# ---------------------------------------------------------------------------------------------
# sources

def digest(data: bytes) -> bytes:
    return hashlib.sha1(data).digest()


def python_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    roots = [paths["stdlib"], paths["purelib"], paths["platlib"], "/usr/lib/python3", "/usr/lib/google-cloud-sdk"]
    seen, out = set(), []
    for root in roots:
        real = os.path.realpath(root)
        if real not in seen and os.path.isdir(real):
            seen.add(real)
            out.append(Path(real))
    return out


def files_under(roots: list[Path], accept) -> list[Path]:
    found = set()
    for root in roots:
        for folder, dirs, names in os.walk(root):
            dirs.sort()
            for name in names:
                path = os.path.join(folder, name)
                if accept(name) and os.path.isfile(path) and not os.path.islink(path):
                    found.add(os.path.realpath(path))
    return [Path(p) for p in sorted(found)]


def distinct_texts(paths: list[Path], read, budget: int, largest: int = 0) -> list[tuple[str, str]]:
    """(name, text) of distinct documents: the `largest` biggest files first, then files in hash
    order until `budget` bytes of text; returned in hash order (long documents spread over shards)."""
    sizes = {p: p.stat().st_size for p in paths}
    by_size = sorted(paths, key=lambda p: (-sizes[p], str(p)))[:largest]
    rest = sorted(set(paths) - set(by_size), key=lambda p: digest(str(p).encode()))
    chosen, seen, total = [], set(), 0
    for path in by_size + rest:
        if total >= budget:
            break
        text = read(path)
        if not text or not text.strip():
            continue
        key = digest(text.encode("utf-8", "surrogatepass"))
        if key in seen:
            continue
        seen.add(key)
        chosen.append((key, str(path), text))
        total += len(text)
    chosen.sort()
    return [(name, text) for _, name, text in chosen]


def read_text(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


_ROFF_FONT = re.compile(r"\\f(\[[^\]]*\]|\(..|.)|\\\*(\[[^\]]*\]|\(..|.)|\\s[-+]?\d+|\\[&|^%:c]|\\[hvwo]'[^']*'")
_ROFF_GLYPHS = {r"\(aq": "'", r"\(dq": '"', r"\(em": "--", r"\(en": "-", r"\(bu": "*", r"\(co": "(c)",
                r"\(lq": '"', r"\(rq": '"', r"\(oq": "'", r"\(cq": "'", r"\(ti": "~", r"\(ha": "^",
                r"\(rs": "\\", r"\(mi": "-", r"\(hy": "-", r"\-": "-", r"\e": "\\", r"\ ": " ", r"\~": " ",
                r"\(pl": "+", r"\(eq": "=", r"\(<=": "<=", r"\(>=": ">="}
_ROFF_OTHER_GLYPH = re.compile(r"\\\(..|\\\[[^\]]*\]")


def roff_text(source: str) -> str:
    """The words of a man page: comments, requests and macro definitions dropped, the arguments of
    text macros (.SH, .B, .IR, mdoc's .Nm ...) kept, escapes replaced by their characters."""
    lines, skipping = [], False
    for line in source.splitlines():
        if skipping:
            skipping = not line.startswith("..")
            continue
        if line.startswith((".\\\"", "'\\\"", '.\\"')) or line in (".", "'"):
            continue
        if line.startswith((".", "'")):
            parts = line[1:].strip().split(None, 1)
            if not parts:
                continue
            macro, args = parts[0], parts[1] if len(parts) > 1 else ""
            if macro in ("de", "de1", "am", "ig"):
                skipping = True
                continue
            if macro in ("SH", "SS", "Sh", "Ss"):
                lines.extend(["", args.replace('"', "").strip()])
            elif macro in ("PP", "LP", "P", "sp", "Pp", "TP", "IP", "br"):
                lines.append("")
                if macro == "IP" and args:
                    lines.append(args.split('"')[1] if args.startswith('"') else args.split()[0])
            elif macro[:1].isupper():
                lines.append(args.replace('"', ""))
            continue
        lines.append(line)
    text = "\n".join(lines)
    for escape, glyph in _ROFF_GLYPHS.items():
        text = text.replace(escape, glyph)
    text = _ROFF_FONT.sub("", text)
    text = _ROFF_OTHER_GLYPH.sub("", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def man_pages() -> list[Path]:
    sections = [p for p in sorted(Path("/usr/share/man").glob("man[1-8]")) if p.is_dir()]
    return files_under(sections, lambda name: True)


def code_files() -> list[Path]:
    return files_under(python_roots(), lambda name: name.endswith(".py"))


def prose_files() -> tuple[list[Path], list[Path]]:
    """(man pages, text documents)."""
    doc_roots = [Path("/usr/share/doc"), *python_roots()]
    texts = [p for p in files_under([r for r in doc_roots if r.is_dir()], lambda n: n.endswith((".txt", ".md", ".rst")))
             if p.stat().st_size >= 2048]
    return man_pages(), texts


def code_documents(budget: int) -> list[tuple[str, str]]:
    return distinct_texts(code_files(), read_text, budget, largest=16)


def prose_documents(budget: int) -> list[tuple[str, str]]:
    pages, texts = prose_files()
    page_set = set(pages)

    def read(path: Path) -> str:
        text = read_text(path)
        return roff_text(text) if path in page_set else text

    docs = distinct_texts(pages + texts, read, budget, largest=4)
    return [(name, text) for name, text in docs if len(text) >= 200]


def fingerprint(name: str) -> dict:
    """How many source files and bytes corpus `name` is chosen from, and a hash of their names and sizes."""
    paths = code_files() if name in ("code", "chat") else []
    if name in ("prose", "chat"):
        pages, texts = prose_files()
        paths += pages + texts
    listing = "\n".join(f"{p}\t{p.stat().st_size}" for p in sorted(paths))
    return {"source_files": len(paths), "source_bytes": sum(p.stat().st_size for p in paths),
            "source_listing_sha1": hashlib.sha1(listing.encode()).hexdigest()}


def function_pairs(path: str, text: str) -> list[tuple[str, str]]:
    """(prompt, response) for each documented function of a Python file: the docstring asks, the
    code (without its docstring) answers."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return []
    lines = text.splitlines()
    pairs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        body = node.body
        if not doc or len(doc) < 40 or len(body) < 2 or node.end_lineno is None:
            continue
        head = "\n".join(lines[node.lineno - 1:body[0].lineno - 1])
        code = "\n".join(lines[body[1].lineno - 1:node.end_lineno])
        prompt = (f"Write a Python function for the module `{Path(path).stem}` with this signature:\n\n"
                  f"{head.strip()}\n\nIt should do the following:\n\n{doc}")
        pairs.append((prompt, f"```python\n{head}\n{code}\n```"))
    return pairs


def section_pairs(name: str, text: str) -> list[tuple[str, str]]:
    """(prompt, response) for each section of a man page: its title asks, its text answers."""
    command = Path(name).name.split(".")[0]
    sections = re.split(r"\n\n([A-Z][A-Z /-]{2,40})\n", "\n\n" + text)
    return [(f"What does the {title.strip()} section of the manual page of `{command}` say?", body.strip())
            for title, body in zip(sections[1::2], sections[2::2]) if len(body.strip()) >= 80]


def chat_documents(budget: int) -> list[tuple[str, str]]:
    code = code_documents(budget)
    prose = prose_documents(budget)
    return alternate_pairs([iter(p for n, t in code for p in function_pairs(n, t)),
                            iter(p for n, t in prose if "/man/" in n for p in section_pairs(n, t))], budget)


def alternate_pairs(sources: list, budget: int) -> list[tuple[str, str]]:
    """(prompt, response) pairs taken from each source in turn until `budget` characters of text
    are reached, then ordered by their hashes: sources [a1 a2 a3], [b1] -> a1 b1 a2 a3 (hash order)."""
    pairs, total = [], 0
    while sources and total < budget:
        for source in list(sources):
            pair = next(source, None)
            if pair is None:
                sources.remove(source)
                continue
            pairs.append(pair)
            total += len(pair[0]) + len(pair[1])
    pairs.sort(key=lambda pair: digest((pair[0] + "\0" + pair[1]).encode("utf-8", "surrogatepass")))
    return pairs


# ---------------------------------------------------------------------------------------------
# corpus

def tokenize_documents(tok: Tekken, texts: list[str], batch: int = 2048) -> list[np.ndarray]:
    out = []
    for lo in range(0, len(texts), batch):
        out.extend(tok.encode(texts[lo:lo + batch]))
    return out


def tokenize_pairs(tok: Tekken, pairs: list[tuple[str, str]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    system = tok.encode([SYSTEM_PROMPT])[0]
    prefix = np.concatenate([[tok.bos, tok.begin_system], system, [tok.end_system, tok.begin_inst]]).astype(np.int32)
    prompts = tokenize_documents(tok, [p for p, _ in pairs])
    responses = tokenize_documents(tok, [r for _, r in pairs])
    tokens, labels = [], []
    for prompt, response in zip(prompts, responses):
        asked = np.concatenate([prefix, prompt, np.array([tok.end_inst], np.int32)])
        answered = np.concatenate([response, np.array([tok.eos], np.int32)])
        tokens.append(np.concatenate([asked, answered]))
        labels.append(np.concatenate([np.full(len(asked), IGNORE_INDEX, np.int32), answered]))
    return tokens, labels


def write_shards(directory: Path, columns: dict[str, list[np.ndarray]]) -> None:
    n = len(next(iter(columns.values())))
    lengths = np.array([len(a) for a in next(iter(columns.values()))], dtype=np.int64)
    bounds = np.linspace(0, n, SHARDS + 1).astype(np.int64)
    for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        offsets = np.zeros(hi - lo + 1, dtype=np.int32)
        np.cumsum(lengths[lo:hi], out=offsets[1:])
        table = pa.table({name: pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(arrays[lo:hi])))
                          for name, arrays in columns.items()})
        pq.write_table(table, directory / f"shard-{k:05d}.parquet", compression="zstd", compression_level=3,
                       row_group_size=ROW_GROUP_ROWS)


def build(name: str, root: str | Path = "/tmp/packctl-bench", *, text_bytes: int | None = None,
          rebuild: bool = False) -> Path:
    """Write (or reuse) corpus `name` under `root`/real-`name`; returns the directory."""
    text_bytes = text_bytes or DEFAULT_BYTES[name]
    directory = Path(root) / f"real-{name}"
    marker = directory / "corpus.json"
    stamp = {"corpus": name, "builder": BUILDER_VERSION, "tokenizer": TOKENIZER_FILE, "text_bytes": text_bytes,
             "sources": fingerprint(name)}
    if not rebuild and marker.exists():
        cached = json.loads(marker.read_text())
        if {k: cached.get(k) for k in stamp} == stamp:
            return directory
    t0 = time.perf_counter()
    docs = {"code": code_documents, "prose": prose_documents, "chat": chat_documents}[name](text_bytes)
    gathered = time.perf_counter() - t0
    tok = Tekken()
    if name == "chat":
        tokens, labels = tokenize_pairs(tok, docs)
        columns = {"input_ids": tokens, "labels": labels}
    else:
        tokens = tokenize_documents(tok, [text for _, text in docs])
        columns = {"input_ids": tokens}
    tokenized = time.perf_counter() - t0 - gathered
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*.parquet"):
        old.unlink()
    write_shards(directory, columns)
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    longest = int(np.argmax(lengths))
    stamp.update({"documents": len(docs), "tokens": int(lengths.sum()), "longest_tokens": int(lengths[longest]),
                  "longest_document": docs[longest][0] if name != "chat" else "(pair)",
                  "median_tokens": float(np.median(lengths)), "p99_tokens": float(np.percentile(lengths, 99)),
                  "seconds": {"gather": round(gathered, 1), "tokenize": round(tokenized, 1),
                              "total": round(time.perf_counter() - t0, 1)}})
    marker.write_text(json.dumps(stamp, indent=1))
    return directory


def describe(directory: Path) -> dict:
    return json.loads((directory / "corpus.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpora", nargs="*", metavar="CORPUS", help=f"any of {', '.join(CORPORA)} (default: all)")
    ap.add_argument("--dir", default="/tmp/packctl-bench")
    ap.add_argument("--rebuild", action="store_true")
    args = ap.parse_args()
    unknown = set(args.corpora) - set(CORPORA)
    if unknown:
        ap.error(f"unknown corpus {', '.join(sorted(unknown))}: choose from {', '.join(CORPORA)}")
    for name in args.corpora or CORPORA:
        stamp = describe(build(name, args.dir, rebuild=args.rebuild))
        print(f"{name}: {stamp['documents']:,} documents, {stamp['tokens']:,} tokens, "
              f"longest {stamp['longest_tokens']:,} ({stamp['longest_document']}), median {stamp['median_tokens']:,.0f}, p99 {stamp['p99_tokens']:,.0f}; "
              f"built in {stamp['seconds']}")


if __name__ == "__main__":
    main()
