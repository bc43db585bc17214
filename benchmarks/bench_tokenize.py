"""What the loss masks of `packctl tokenize` cost over encoding alone.

    python benchmarks/bench_tokenize.py [--conversations 2000] [--threads 2] [--vocab 8192] [--repeats 7]

The tokenizer: a byte-level BPE trained here on the docstrings of the interpreter's stdlib (about
2 MB of English and code, `--vocab` ids, the special tokens of tests/support/tokenizers.py). The
conversations: 3 to 8 turns (a system turn in half of them, then user and assistant alternating),
each turn a few hundred tokens of docstring text, drawn with a fixed seed.

For each template (ChatML and Llama-3, with `{% generation %}` blocks and without them, where the
prefix rule renders 2 growing prefixes per assistant turn), the time of:

    encode    tokenizer.encode_batch(rendered texts, add_special_tokens=False): the texts rendered
              beforehand, the bare cost of the ids
    records   tokenize_records(records): rendering, the prefix renders, the same encode_batch,
              token ranges and labels

and records / encode (the least of --repeats runs, the two alternating), in wall seconds and in CPU seconds of all the
process's threads (steadier on a shared machine). RAYON_NUM_THREADS is set to --threads for both.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import random
import sys
import sysconfig
import tempfile
import time
from pathlib import Path


def docstrings(limit_bytes: int) -> list[str]:
    """Docstrings of the stdlib's modules, in a fixed order, about `limit_bytes` in all."""
    found, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)) and (doc := ast.get_docstring(node)):
                if len(doc) > 200:
                    found.append(doc)
                    total += len(doc)
        if total >= limit_bytes:
            break
    return found


def conversations(texts: list[str], count: int, seed: int = 0) -> list[list[dict]]:
    rng = random.Random(seed)
    made = []
    for _ in range(count):
        turns = rng.randint(3, 8)
        messages = [{"role": "system", "content": "You are a careful assistant."}] if rng.random() < 0.5 else []
        for t in range(turns):
            # a turn of a few hundred tokens: two to four docstrings
            content = "\n\n".join(rng.choice(texts) for _ in range(rng.randint(1, 3)))
            messages.append({"role": "user" if t % 2 == 0 else "assistant", "content": content})
        if messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": rng.choice(texts)})
        made.append(messages)
    return made


def best_times(fns, repeats: int) -> list[tuple[float, float]]:
    """The least wall and CPU (all threads of the process) seconds of each of `fns`, run in turn
    `repeats` times after a warm-up: alternating keeps a busy machine's load on both sides, and
    the least time is the one the load disturbed least."""
    for fn in fns:
        fn()
    best = [(float("inf"), float("inf"))] * len(fns)
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
            best[k] = (min(best[k][0], wall), min(best[k][1], cpu))
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tokenizers import pre_tokenizers, trainers

    from packctl.tokenize.encode import TokenizeSpec, tokenize_records
    from packctl.tokenize.formats import RecordFormat
    from packctl.tokenize.tokenizer import LocalTokenizer
    from support import tokenizers as support

    texts = docstrings(2_000_000)
    tok = support.train_tokenizer(vocab_size=256)
    trainer = trainers.BpeTrainer(vocab_size=args.vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False, special_tokens=support.SPECIAL_TOKENS + ["<think>", "</think>"])
    tok.train_from_iterator(texts, trainer=trainer)
    convs = conversations(texts, args.conversations)
    records = [{"messages": conv} for conv in convs]
    spec = TokenizeSpec(format=RecordFormat.MESSAGES)
    print(f"{len(convs)} conversations, {args.threads} threads, vocab {tok.get_vocab_size()}")
    print("| template | tokens | encode s (cpu s) | records s (cpu s) | records / encode, wall (cpu) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, template in (("ChatML", support.CHATML), ("Llama-3", support.LLAMA3)):
            for label, text in (("generation blocks", template), ("prefix rule", support.without_generation(template))):
                directory = Path(tmp) / f"{name}-{label}".replace(" ", "_")
                directory.mkdir()
                tok.save(str(directory / "tokenizer.json"))
                (directory / "tokenizer_config.json").write_text(json.dumps(
                    {"bos_token": "<|begin_of_text|>", "eos_token": "</s>", "chat_template": text}))
                local = LocalTokenizer.load(str(directory))
                rendered = [local.render(conv).text for conv in convs]
                encode, full = best_times([lambda: local.encode_batch(rendered, add_special_tokens=False),
                                           lambda: tokenize_records(records, spec, local)], args.repeats)
                tokens = len(tokenize_records(records, spec, local).input_ids)
                print(f"| {name}, {label} | {tokens:,} | {encode[0]:.3f} ({encode[1]:.3f}) "
                      f"| {full[0]:.3f} ({full[1]:.3f}) | {full[0] / encode[0]:.2f} ({full[1] / encode[1]:.2f}) |")


if __name__ == "__main__":
    main()
