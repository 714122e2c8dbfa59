"""Token frequencies for Maximus shard plans: from a counts file or from text tokenized with the
model's own tokenizer. Never unpickles (``.npy`` is read with ``allow_pickle=False``)."""

from __future__ import annotations

from pathlib import Path

from lct.errors import SourceError

# What LCT reads as text in a folder, for token counts here and for lct verify --quality's
# scoring (lct.conversion.quality): one list, prose, markup and source code alike
TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst", ".html", ".jsonl", ".json", ".csv", ".tsv",
                 ".jinja", ".py", ".c", ".h", ".js")
MAX_TEXT_BYTES = 4 * 1024**3


def _from_list(values, vocab_size: int, where: str):
    import torch
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    if len(values) > vocab_size:
        raise SourceError(f"{where}: {len(values)} counts for a vocabulary of {vocab_size}")
    for i, v in enumerate(values):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise SourceError(f"{where}: count for token {i} is {v!r}; expected an integer >= 0")
    if values:
        counts[: len(values)] = torch.tensor(values, dtype=torch.int64)  # one copy, not V
    return counts


def _from_json(path: Path, vocab_size: int):
    from lct.format.jsontext import read_json
    data = read_json(path, SourceError)
    if isinstance(data, list):
        return _from_list(data, vocab_size, str(path))
    if isinstance(data, dict):
        values = [0] * vocab_size
        for k, v in data.items():
            try:
                i = int(k)
            except ValueError:
                raise SourceError(f"{path}: key {k!r} is not a token id") from None
            if not 0 <= i < vocab_size:
                raise SourceError(f"{path}: token id {i} outside the vocabulary 0..{vocab_size - 1}")
            values[i] = v
        return _from_list(values, vocab_size, str(path))
    raise SourceError(f"{path}: expected a JSON list of counts or an object id -> count")


def _from_npy(path: Path, vocab_size: int):
    import numpy as np
    import torch
    try:
        arr = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise SourceError(f"{path}: not a readable .npy array ({e})") from e
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise SourceError(f"{path}: expected a 1-D integer array, got {arr.dtype} {arr.shape}")
    if arr.size > vocab_size:
        raise SourceError(f"{path}: {arr.size} counts for a vocabulary of {vocab_size}")
    if arr.size and arr.min() < 0:
        raise SourceError(f"{path}: negative counts")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    counts[: arr.size] = torch.from_numpy(arr.astype(np.int64))
    return counts


def _from_text(path: Path, vocab_size: int, tokenizer_dir: Path):
    import torch
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise SourceError(f"{path}: no text files ({', '.join(TEXT_SUFFIXES)})")
    if not any((tokenizer_dir / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        raise SourceError(f"{tokenizer_dir}: the model has no tokenizer to count {path} with; "
                          f"pass a counts file (.json or .npy) instead")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    total = 0
    for f in files:
        total += f.stat().st_size
        if total > MAX_TEXT_BYTES:
            raise SourceError(f"{path}: more than {MAX_TEXT_BYTES} bytes of text; sample it")
        text = f.read_text(errors="replace")
        for start in range(0, len(text), 1 << 20):
            ids = tok(text[start:start + (1 << 20)], add_special_tokens=False).input_ids
            if ids:
                t = torch.tensor(ids, dtype=torch.int64)
                if int(t.max()) >= vocab_size:
                    raise SourceError(f"{f}: the tokenizer produced id {int(t.max())} outside the "
                                      f"model's vocabulary of {vocab_size}")
                counts += torch.bincount(t, minlength=vocab_size)
    return counts


def token_counts(source, vocab_size: int, tokenizer_dir=None) -> tuple:
    """Token counts ``[vocab_size]`` (int64) and a description of where they came from.

    Args:
        source: a ``.json`` counts file (list indexed by id, or object id -> count), a ``.npy``
            1-D array, or a text file / folder tokenized with the tokenizer in ``tokenizer_dir``.
        vocab_size: the model's vocabulary size.
        tokenizer_dir: the model folder holding its tokenizer (for text sources).

    Raises:
        SourceError: unreadable or inconsistent input, named with the file.
    """
    path = Path(source)
    if not path.exists():
        raise SourceError(f"{path}: no such token-frequency file or folder")
    if path.is_file() and path.suffix == ".npy":
        counts, kind = _from_npy(path, vocab_size), "counts-npy"
    elif path.is_file() and path.suffix == ".json" and _looks_like_counts(path):
        counts, kind = _from_json(path, vocab_size), "counts-json"
    else:
        counts, kind = _from_text(path, vocab_size, Path(tokenizer_dir or path)), "text"
    if int(counts.sum()) == 0:
        raise SourceError(f"{path}: counts no token at all, so it cannot order the shards; give "
                          f"text of the kind the model will see, or non-zero counts")
    return counts, {"kind": kind, "path": str(path.absolute()), "tokens": int(counts.sum())}


def _looks_like_counts(path: Path) -> bool:
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
    return head[:1] in (b"[", b"{")
