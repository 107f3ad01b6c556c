"""The corpus every machine has offline: the Python standard library's own source.

Files are split into training and held-out sets by a hash of their path, so the training tool
and the benchmark agree on which files the model never saw.
"""
from __future__ import annotations

import hashlib
import math
import sysconfig
from pathlib import Path

HELD_OUT_PERCENT = 5
_SKIP = {"test", "tests", "idlelib", "site-packages", "lib2to3"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files), both sorted; test suites and vendored packages excluded."""
    root = stdlib_root()
    files = sorted(f for f in root.rglob("*.py") if not _SKIP & set(f.relative_to(root).parts))
    train, held = [], []
    for f in files:
        bucket = int(hashlib.sha1(str(f.relative_to(root)).encode()).hexdigest(), 16) % 100
        (held if bucket < HELD_OUT_PERCENT else train).append(f)
    return train, held


def read_source(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def heldout_chunks(min_chars: int = 200, max_chars: int = 400) -> list[str]:
    """Every run of whole lines of `min_chars`..`max_chars` characters the held-out files cut into,
    in file order."""
    _, held = corpus_files()
    chunks: list[str] = []
    for f in held:
        lines = read_source(f).splitlines(keepends=True)
        cur = ""
        for line in lines:
            cur += line
            if len(cur) >= min_chars:
                if len(cur) <= max_chars and cur.strip():
                    chunks.append(cur)
                cur = ""
    if not chunks:
        raise RuntimeError("no held-out prompts could be cut from the standard library source")
    return chunks


def heldout_prompts(num_prompts: int, min_chars: int = 200, max_chars: int = 400) -> list[str]:
    """Code prompts cut from held-out files at line boundaries, deterministic.

    Each prompt is a run of whole lines of `min_chars`..`max_chars` characters, taken from evenly
    spaced places across the held-out files.
    """
    chunks = heldout_chunks(min_chars, max_chars)
    step = max(1, len(chunks) // num_prompts)
    return [chunks[(i * step) % len(chunks)] for i in range(num_prompts)]


def spread(items: list[str]) -> list[str]:
    """`items` reordered so that any leading slice samples all of them evenly (a fixed stride
    coprime with their count), each once."""
    n = len(items)
    if n == 0:
        return []
    stride = next(s for s in range(max(2, math.isqrt(n)), n + 2) if math.gcd(s, n) == 1)
    return [items[(i * stride) % n] for i in range(n)]
