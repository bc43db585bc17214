"""The shape of packctl's code, counted from its source: the largest modules, and the functions
over 80 lines or over 8 parameters, numba kernels left out (a kernel takes its arrays one by one).

    python tools/code_shape.py [--top 10] [--list]

A function's length is its lines from `def` to its last statement, docstring included; its
parameters count positional, keyword-only, *args and **kwargs, `self` and `cls` not. A numba kernel
is a function decorated with `njit`/`jit` (packctl.jit or numba). The width of the functions of
`EXEMPT` is counted apart, each with its reason (their length is counted as any other's). For example:

    largest 10 modules (lines):
        1165  packctl/torch.py
        ...
    functions over 80 lines: 16
    functions over 8 parameters: 23
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LONG, WIDE = 80, 8

# "module:function" -> why its width stays (its length is counted): a typer command's parameters are its options, one each,
# as `--help` lists them; grouping them would move typer's parsing into code of packctl's own. The
# same holds for a declaration whose keywords are what it declares, and for a public API's options.
EXEMPT = {
    "packctl/cli/tokenize.py:tokenize_command": "a typer command: its parameters are its options",
    "packctl/cli/sample.py:sample_command": "a typer command: its parameters are its options",
    "packctl/cli/verify.py:verify_command": "a typer command: its parameters are its options",
    "packctl/cli/export.py:export_command": "a typer command: its parameters are its options",
    "packctl/config.py:option": "declares a PackConfig option: each keyword is one attribute of it (help, panel, "
                                "flag, ...), named at every field",
    "packctl/pipeline/from_plan.py:materialize_plan": "the Python API of `packctl materialize`: its keyword "
                                                      "parameters are the command's options, as pack's are PackConfig's",
    "packctl/plan/algorithms.py:pack_lengths": "public API: its keyword parameters are the packing options "
                                               "its docstring and docs/algorithms.md document",
    "packctl/online/__init__.py:plan_packs": "public (docs/online.md): its keywords are pack's planning options",
    "packctl/online/__init__.py:plan_steps": "public (docs/online.md): its keywords are pack's --dp-size options",
    "packctl/export/run.py:export": "public (packctl.export): packctl export's options, its progress and test faults",
}


def _is_kernel(node: ast.FunctionDef) -> bool:
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name in ("njit", "jit", "vectorize", "guvectorize"):
            return True
    return False


def _parameters(node: ast.FunctionDef) -> int:
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return len([n for n in names if n not in ("self", "cls")])


def shape(package: Path) -> tuple[list[tuple[str, int]], list[tuple[str, int]], list[tuple[str, int]]]:
    """(modules and their lines, largest first; long functions; wide functions), paths relative
    to the checkout."""
    modules, long, wide = [], [], []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        rel = str(path.relative_to(ROOT))
        modules.append((rel, len(text.splitlines())))
        for node in ast.walk(ast.parse(text, filename=rel)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or _is_kernel(node):
                continue
            where = f"{rel}:{node.lineno} {node.name}"
            if node.end_lineno - node.lineno + 1 > LONG:
                long.append((where, node.end_lineno - node.lineno + 1))
            if _parameters(node) > WIDE and f"{rel}:{node.name}" not in EXEMPT:
                wide.append((where, _parameters(node)))
    modules.sort(key=lambda m: -m[1])
    return modules, sorted(long, key=lambda f: -f[1]), sorted(wide, key=lambda f: -f[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=10, help="how many of the largest modules to list")
    parser.add_argument("--list", action="store_true", help="list the long and the wide functions too")
    args = parser.parse_args()
    modules, long, wide = shape(ROOT / "packctl")
    print(f"modules: {len(modules)}, lines: {sum(n for _, n in modules)}")
    print(f"largest {args.top} modules (lines):")
    for rel, lines in modules[:args.top]:
        print(f"  {lines:6d}  {rel}")
    print(f"functions over {LONG} lines: {len(long)}")
    print(f"functions over {WIDE} parameters: {len(wide)}")
    print(f"wide by design (EXEMPT): {len(EXEMPT)}")
    if args.list:
        for title, rows in ((f"over {LONG} lines", long), (f"over {WIDE} parameters", wide)):
            print(title + ":")
            for where, n in rows:
                print(f"  {n:4d}  {where}")
        print("wide by design (EXEMPT):")
        for where, why in EXEMPT.items():
            print(f"        {where}: {why}")


if __name__ == "__main__":
    main()
