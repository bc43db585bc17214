"""Dataset splits in a directory INPUT, named as the Hugging Face Hub names them (the rules of
`datasets.data_files`), so that `train` and `test` files are never packed as one corpus.

A file's split, from its path below the directory INPUT, by the first rule that finds splits in
the directory (as `datasets` tries them):

    1. sharded: data/{split}-00000-of-00002.parquet              any split name
    2. a directory named by a split keyword: train/a.parquet, test_2024/b.parquet, my-val/c.parquet
    3. a file name with a split keyword: train-00000.parquet, wiki.test.parquet, dev_1.parquet

Keywords (a word between separators `-`, `.`, `_`, space or digits, or at an end): train,
training -> train; validation, valid, dev, val -> validation; test, testing, eval, evaluation ->
test. A directory with files of two or more splits is refused unless `--split NAME` selects
one; a directory of one split (or none) is read whole, as any directory.

    split_files(["data/train-00000-of-00002.parquet", "data/test-00000-of-00001.parquet"])
    -> {"train": ["data/train-00000-of-00002.parquet"], "test": ["data/test-00000-of-00001.parquet"]}
"""
from __future__ import annotations

import re

from packctl.errors import PackctlError

KEYWORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
            "test": ("test", "testing", "eval", "evaluation")}
_SEP = r"[-._ 0-9]"
_SHARDED = re.compile(r"^data/(?P<split>\w+?)-[0-9]{5}-of-[0-9]{5}[^/]*\.[^/]*$")


def _word(keyword: str) -> re.Pattern:
    """`keyword` as a word of a name: at its start or after a separator, and at its end or before one."""
    return re.compile(rf"(^|{_SEP}){keyword}({_SEP}|$)")


_WORDS = {split: [_word(k) for k in keywords] for split, keywords in KEYWORDS.items()}


def _named(name: str) -> str | None:
    """The split whose keyword is a word of `name` (the first of train, validation, test)."""
    return next((split for split, words in _WORDS.items() if any(w.search(name) for w in words)), None)


def _by_directory(path: str) -> str | None:
    return next((s for s in (_named(part) for part in path.split("/")[:-1]) if s is not None), None)


def _by_file_name(path: str) -> str | None:
    return _named(path.rsplit("/", 1)[-1])


def split_files(paths: list[str]) -> dict[str, list[str]]:
    """The files of each split among `paths` (relative to the directory INPUT, `/`-separated), by
    the first rule of the module docstring that finds any; {} when none does."""
    sharded = {p: m["split"] for p in paths if (m := _SHARDED.match(p))}
    for rule in (sharded.get, _by_directory, _by_file_name):
        found: dict[str, list[str]] = {}
        for path in paths:
            split = rule(path)
            if split is not None:
                found.setdefault(split, []).append(path)
        if found:
            return found
    return {}


def select_split(directory: str, paths: list[str], split: str | None) -> list[str]:
    """The files of the directory INPUT `directory` to read: all of them when they hold at most one
    split and `split` is None; else those of `split`. Refused in one line: two splits and no
    `split`, or a `split` the directory does not hold."""
    splits = split_files(paths)
    names = ", ".join(sorted(splits, key=lambda s: (s not in KEYWORDS, list(KEYWORDS).index(s) if s in KEYWORDS
                                                    else 0, s)))
    if split is None:
        if len(splits) > 1:
            example = {s: files[0] for s, files in splits.items()}
            shown = ", ".join(f"{s} ({example[s]})" for s in sorted(example))
            raise PackctlError(f"{directory}: holds the dataset splits {shown}; packing them as one corpus would mix "
                               f"them: pass --split NAME (one of {names}), or name the files to read")
        return paths
    if split not in splits:
        held = f"it holds the splits {names}" if splits else "it holds no split (no train/validation/test names)"
        raise PackctlError(f"--split {split}: {directory} has no file of that split ({held}); choose one of its "
                           "splits, or leave --split out")
    return splits[split]
