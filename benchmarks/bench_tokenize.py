"""`packctl tokenize` on real text, against a bare `tokenizers` encode_batch and `datasets.map`.

    python benchmarks/bench_tokenize.py [--size 8] [--dir /tmp/packctl-bench] [--profile]

The target: encoding is the only real cost of `packctl tokenize`. Rendering the chat template,
building the loss masks and writing Parquet together cost at most 15% over a bare
`tokenizers.Tokenizer.encode_batch` of the same rendered texts on the same number of threads.

Data, from the real text of benchmarks/realtext.py (a Python function's docstring asks, the
function answers; a man page's section title asks, the section answers), `--size` MB of chat text:

| set | records |
|---|---|
| `chat` | `messages`: a system prompt, then 1-4 user/assistant turns (consecutive pairs) |
| `preference` | `prompt` (system + user), `chosen` (its answer), `rejected` (another pair's answer); 1/4 of the size |
| `text` | `text`: man pages and documents (realtext's prose); 1/4 of the size |

Tokenizer: a 32,000-id byte-level BPE trained with the `tokenizers` library on the chat set's own
text (prompts and answers, the first 8 MB; seconds, once, cached beside the data), with ChatML's
special tokens. Trained
here rather than converted from a tiktoken vocabulary because it needs no package beyond the
`tokenizers` packctl already uses and no file from the network; its pre-tokenizer, model and
vocabulary size are those of the production byte-level BPEs (GPT-2 to Qwen), which is what
decides the encoding speed. Two directories share it: `chatml` (Qwen's template, no generation
block: packctl finds the assistant turns by rendering prefixes) and `chatml-generation` (the same
text, the assistant turns in `{% generation %}` blocks, which transformers'
`return_assistant_tokens_mask` needs).

Measured, each in its own process (RAYON_NUM_THREADS fixes the tokenizers thread pool when a
process starts), N = the machine's cores:

    (a) encode     tokenizers.Tokenizer.encode_batch of the rendered texts, 1 thread and N threads
    (b) records    packctl.tokenize.encode.tokenize_records over batches of --shard-records
                   records, 1 thread
    (c) command    tokenize_corpus (what `packctl tokenize` runs, in process): JSONL read,
                   tokenized, Parquet written and committed; --workers 1 (1 thread) and --workers N
    (d) datasets   datasets.Dataset.map(apply_chat_template(..., return_assistant_tokens_mask=True,
                   return_dict=True)) with PreTrainedTokenizerFast(tokenizer_file=...), batched,
                   num_proc 1 and N (1 thread each)

Each line gives tokens/s, tokens/s per core, and the time over (a) on the same threads; the
machine's load average is printed before and after (other work on the machine slows every line,
(a) too, so each line is the fastest of `--repeat` runs). `--profile` prints cProfile's top
entries of (b) on the chat set.
"""
from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import os
import pstats
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

VOCAB_SIZE = 32_000
TRAIN_BYTES = 8 << 20
SYSTEM_PROMPT = "You are a helpful assistant for programmers and system administrators. Answer precisely."
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's ChatML, written out (a system turn is the first message of every chat here).
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML_GENERATION = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SHARD_RECORDS = 500
FIXED_RECORDS = 20  # a run this small costs what any run costs: start the workers, load, index, commit
BUILDER_VERSION = 1


# ---------------------------------------------------------------------------------------------
# data and tokenizer

def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha1(text.encode("utf-8", "surrogatepass")).digest()[:4], "little")


def chat_pairs(budget: int) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of realtext's chat corpus, from files in hash order only (realtext
    starts its code with the largest files, megabytes of generated code with few docstrings)."""
    from realtext import (alternate_pairs, code_files, distinct_texts, function_pairs, man_pages, read_text,
                          roff_text, section_pairs)

    code = distinct_texts(code_files(), read_text, budget)
    prose = distinct_texts(man_pages(), lambda path: roff_text(read_text(path)), budget)
    return alternate_pairs([iter(p for n, t in code for p in function_pairs(n, t)),
                            iter(p for n, t in prose for p in section_pairs(n, t))], budget)


def prose_texts(budget: int) -> list[str]:
    """Man pages and documents of realtext's prose corpus, in hash order only."""
    from realtext import distinct_texts, prose_files, read_text, roff_text

    pages, documents = prose_files()
    page_set = set(pages)

    def read(path: Path) -> str:
        text = read_text(path)
        return roff_text(text) if path in page_set else text

    return [text for _, text in distinct_texts(pages + documents, read, budget) if len(text) >= 200]


def build_data(root: Path, size_mb: int) -> Path:
    """chat.jsonl, preference.jsonl and text.jsonl of about `size_mb` MB of chat text under
    root/tokenize-SIZE (reused when present)."""
    folder = root / f"tokenize-{size_mb}"
    stamp = folder / "data.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("builder") == BUILDER_VERSION:
        return folder
    budget = size_mb << 20
    t0 = time.perf_counter()
    pairs = chat_pairs(budget)
    folder.mkdir(parents=True, exist_ok=True)
    chats, k = [], 0
    while k < len(pairs):
        turns = 1 + _hash(pairs[k][0]) % 4
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        for prompt, answer in pairs[k:k + turns]:
            messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        chats.append({"messages": messages})
        k += turns
    preference, used = [], 0
    for i, (prompt, answer) in enumerate(pairs):
        if used >= budget // 4:
            break
        other = pairs[(i + 1 + _hash(prompt) % 97) % len(pairs)][1]
        preference.append({"prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}],
                           "chosen": [{"role": "assistant", "content": answer}],
                           "rejected": [{"role": "assistant", "content": other}]})
        used += len(prompt) + len(answer) + len(other)
    texts = [{"text": text} for text in prose_texts(budget // 4)]
    for name, records in (("chat", chats), ("preference", preference), ("text", texts)):
        with open(folder / f"{name}.jsonl", "w", encoding="utf-8") as fh:
            for record in records:
                fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    stamp.write_text(json.dumps({"builder": BUILDER_VERSION, "seconds": round(time.perf_counter() - t0, 1),
                                 "records": {"chat": len(chats), "preference": len(preference), "text": len(texts)}}))
    return folder


def build_tokenizer(data: Path) -> tuple[Path, Path]:
    """(chatml, chatml-generation): two directories of one 32k byte-level BPE trained on the first
    TRAIN_BYTES of chat.jsonl's contents, under `data`."""
    folder = data / "bpe32k"
    plain, generation = folder / "chatml", folder / "chatml-generation"
    if not (generation / "tokenizer_config.json").exists():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

        def lines():
            seen = 0
            with open(data / "chat.jsonl", encoding="utf-8") as fh:
                for line in fh:
                    for message in json.loads(line)["messages"][1:]:
                        yield message["content"]
                        seen += len(message["content"])
                    if seen >= TRAIN_BYTES:
                        return

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(lines(), trainer=trainer)
        for directory, template in ((plain, CHATML), (generation, CHATML_GENERATION)):
            directory.mkdir(parents=True, exist_ok=True)
            tok.save(str(directory / "tokenizer.json"))
            config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
                      "pad_token": "<|endoftext|>", "model_max_length": 1 << 20, "chat_template": template}
            (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return plain, generation


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


# ---------------------------------------------------------------------------------------------
# measurements (each runs in a child process: see main)

def rendered_texts(tokenizer_dir: Path, records: list[dict]) -> list[str]:
    """The texts `packctl tokenize` encodes, each record's rows as tokenize_records builds them
    before its one encode_batch (the row builder is internal to encode.py: no public call gives
    the texts without encoding them)."""
    from packctl.tokenize.encode import TokenizeSpec, _RowBuilder
    from packctl.tokenize.tokenizer import LocalTokenizer

    tok = LocalTokenizer.load(str(tokenizer_dir))
    spec = TokenizeSpec()
    fmt, loss_on = spec.resolve(set(records[0]))
    builder = _RowBuilder(spec, fmt, loss_on, tok)
    return [row.text for i, r in enumerate(records) for row in builder.rows(i, r)]


class Clock:
    """Wall seconds and CPU seconds (user + system, of this process and of the worker processes
    it has waited for) since it was made: CPU time moves less than wall time when other work
    shares the machine."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), self._cpu()

    @staticmethod
    def _cpu() -> float:
        own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime

    def read(self, tokens: int) -> dict:
        return {"seconds": time.perf_counter() - self.wall, "cpu": self._cpu() - self.cpu, "tokens": tokens}


def measure_encode(tokenizer_dir: Path, jsonl: Path) -> dict:
    from tokenizers import Tokenizer

    texts = rendered_texts(tokenizer_dir, read_jsonl(jsonl))
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    clock = Clock()
    tokens = 0
    for lo in range(0, len(texts), SHARD_RECORDS):
        tokens += sum(len(e.ids) for e in tok.encode_batch(texts[lo:lo + SHARD_RECORDS], add_special_tokens=False))
    return clock.read(tokens)


def measure_records(tokenizer_dir: Path, jsonl: Path, profile: bool = False) -> dict:
    from packctl.tokenize.encode import TokenizeSpec, tokenize_records
    from packctl.tokenize.tokenizer import LocalTokenizer

    records = read_jsonl(jsonl)
    tok = LocalTokenizer.load(str(tokenizer_dir))
    spec = TokenizeSpec()
    profiler = cProfile.Profile() if profile else None
    clock = Clock()
    if profiler:
        profiler.enable()
    tokens = 0
    for lo in range(0, len(records), SHARD_RECORDS):
        tokens += int(tokenize_records(records[lo:lo + SHARD_RECORDS], spec, tok).offsets[-1])
    out = clock.read(tokens)
    if profiler:
        profiler.disable()
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(18)
        out["profile"] = stream.getvalue()
    return out


def measure_command(tokenizer_dir: Path, jsonl: Path, workers: int, scratch: Path, head: int = 0) -> dict:
    """tokenize_corpus on `jsonl` (its first `head` records when given: the fixed cost of a run),
    the modules the command imports at start-up imported before the clock starts."""
    import packctl.tokenize.encode  # noqa: F401
    import pyarrow.parquet  # noqa: F401
    from packctl.tokenize.run import TokenizeConfig, tokenize_corpus

    if head:
        with open(jsonl, encoding="utf-8") as fh:
            lines = [fh.readline() for _ in range(head)]
        jsonl = scratch / f"head-{os.getpid()}.jsonl"
        jsonl.write_text("".join(lines), encoding="utf-8")
    out = scratch / f"out-{os.getpid()}"
    shutil.rmtree(out, ignore_errors=True)
    clock = Clock()
    shard_records = max(1, head // workers) if head else SHARD_RECORDS  # a fixed-cost run starts every worker
    result = tokenize_corpus(TokenizeConfig(inputs=[str(jsonl)], output=str(out), tokenizer=str(tokenizer_dir),
                                            workers=workers, shard_records=shard_records))
    measured = clock.read(result.counts["tokens"])
    shutil.rmtree(out, ignore_errors=True)
    return measured


def measure_datasets(tokenizer_dir: Path, jsonl: Path, num_proc: int, scratch: Path) -> dict:
    """As an SFT script does it: the template's generation blocks give the assistant mask."""
    os.environ["HF_DATASETS_CACHE"] = str(scratch / "hf-datasets")
    import datasets
    from transformers import PreTrainedTokenizerFast

    datasets.disable_progress_bars()
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"), eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHATML_GENERATION
    dataset = datasets.Dataset.from_list(read_jsonl(jsonl))

    def apply(batch):
        out = tok.apply_chat_template(batch["messages"], tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        return {"input_ids": out["input_ids"], "assistant_masks": out["assistant_masks"]}

    clock = Clock()
    mapped = dataset.map(apply, batched=True, batch_size=SHARD_RECORDS, num_proc=num_proc if num_proc > 1 else None,
                         remove_columns=dataset.column_names, keep_in_memory=True)
    return clock.read(sum(len(ids) for ids in mapped["input_ids"]))


def child(args) -> None:
    tokenizer_dir, jsonl, scratch = Path(args.tokenizer), Path(args.jsonl), Path(args.scratch)
    if args.child == "encode":
        out = measure_encode(tokenizer_dir, jsonl)
    elif args.child == "records":
        out = measure_records(tokenizer_dir, jsonl, args.profile)
    elif args.child == "command":
        out = measure_command(tokenizer_dir, jsonl, args.workers, scratch, args.head)
    else:
        out = measure_datasets(tokenizer_dir, jsonl, args.workers, scratch)
    print("RESULT " + json.dumps(out))


def run_child(kind: str, tokenizer_dir: Path, jsonl: Path, scratch: Path, *, threads: int, workers: int = 1,
              profile: bool = False, repeat: int = 1, head: int = 0) -> dict:
    """The fastest of `repeat` runs of measurement `kind`, each in a fresh process."""
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true" if threads > 1 else "false")
    repo = str(HERE.parent)
    env["PYTHONPATH"] = repo + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    command = [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--tokenizer", str(tokenizer_dir),
               "--jsonl", str(jsonl), "--scratch", str(scratch), "--workers", str(workers)]
    if profile:
        command.append("--profile")
    if head:
        command += ["--head", str(head)]
    best = None
    for _ in range(repeat):
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            sys.exit(f"{kind} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        result = json.loads(lines[-1][len("RESULT "):])
        if best is None or result["seconds"] < best["seconds"]:
            best = result
    return best


# ---------------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=8, help="MB of chat text (default 8); the other sets get a quarter")
    ap.add_argument("--dir", default="/tmp/packctl-bench")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each measurement, the fastest kept (default 2)")
    ap.add_argument("--sets", nargs="*", default=["chat", "preference", "text"])
    ap.add_argument("--no-datasets", action="store_true", help="skip (d)")
    ap.add_argument("--profile", action="store_true", help="print cProfile's top entries of (b) on the chat set")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)
    ap.add_argument("--jsonl", help=argparse.SUPPRESS)
    ap.add_argument("--scratch", help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--head", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    root = Path(args.dir)
    cores = os.cpu_count() or 1
    t0 = time.perf_counter()
    data = build_data(root, args.size)
    plain, generation = build_tokenizer(data)
    scratch = root / "tokenize-scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    print(f"data {data} ({json.loads((data / 'data.json').read_text())['records']}), tokenizer {plain.parent} "
          f"({VOCAB_SIZE:,} ids), ready in {time.perf_counter() - t0:.0f} s; {cores} cores; "
          f"load average before {os.getloadavg()[0]:.2f}")

    header = (f"{'set':<11}{'measure':<40}{'cores':>6}{'wall s':>8}{'cpu s':>8}{'tokens':>11}{'tok/s':>11}"
              f"{'tok/s/core':>11}{'tok/cpu-s':>11}{'wall/(a)':>9}{'cpu/(a)':>8}{'net/(a)':>8}")
    print(header)
    print("-" * len(header))
    for name in args.sets:
        jsonl = data / f"{name}.jsonl"
        base: dict[int, dict] = {}
        fixed: dict[int, dict] = {}

        def line(label: str, result: dict, threads: int, net: dict | None = None) -> None:
            rate = result["tokens"] / result["seconds"]
            ref = base.get(threads) if label[:3] != "(a)" else None
            ratios = ["", "", ""]
            if ref is not None and result["tokens"] == ref["tokens"]:
                ratios[:2] = [f"{result['seconds'] / ref['seconds']:.2f}", f"{result['cpu'] / ref['cpu']:.2f}"]
                if net is not None:
                    ratios[2] = f"{(result['seconds'] - net['seconds']) / ref['seconds']:.2f}"
            print(f"{name:<11}{label:<40}{threads:>6}{result['seconds']:>8.2f}{result['cpu']:>8.2f}{result['tokens']:>11,}"
                  f"{rate:>11,.0f}{rate / threads:>11,.0f}{result['tokens'] / result['cpu']:>11,.0f}"
                  f"{ratios[0]:>9}{ratios[1]:>8}{ratios[2]:>8}", flush=True)

        for threads in sorted({1, cores}):
            base[threads] = run_child("encode", plain, jsonl, scratch, threads=threads, repeat=args.repeat)
            line("(a) encode_batch", base[threads], threads)
        result = run_child("records", plain, jsonl, scratch, threads=1, repeat=args.repeat)
        line("(b) tokenize_records, chatml" if name != "text" else "(b) tokenize_records", result, 1)
        if name != "text":
            result = run_child("records", generation, jsonl, scratch, threads=1, repeat=args.repeat)
            line("(b) tokenize_records, generation block", result, 1)
        for workers in sorted({1, cores}):
            fixed[workers] = run_child("command", plain, jsonl, scratch, threads=1, workers=workers,
                                       repeat=args.repeat, head=FIXED_RECORDS)
            line(f"(c) fixed: {FIXED_RECORDS} records, --workers {workers}", fixed[workers], workers)
            result = run_child("command", plain, jsonl, scratch, threads=1, workers=workers, repeat=args.repeat)
            line(f"(c) packctl tokenize --workers {workers}", result, workers, fixed[workers])
        if name == "chat" and not args.no_datasets:
            for workers in sorted({1, cores}):
                result = run_child("datasets", generation, jsonl, scratch, threads=1, workers=workers, repeat=args.repeat)
                line(f"(d) datasets.map num_proc={workers}", result, workers)
    print(f"load average after {os.getloadavg()[0]:.2f}; {time.perf_counter() - t0:.0f} s in all")
    if args.profile:
        print(run_child("records", plain, data / "chat.jsonl", scratch, threads=1, profile=True)["profile"])
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
