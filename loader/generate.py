"""Timed generation for ``lct load --prompt``: time to first token and tokens per second."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from lct.errors import LCTError
from lct.format import constants as C


@dataclass
class GenerationResult:
    """What one timed ``generate`` produced."""

    text: str
    new_tokens: int
    first_token_s: float      # from the call to the first generated token
    total_s: float
    first_token_at: float     # time.perf_counter() of the first token
    tokenize_s: float = 0.0   # loading the tokenizer and encoding the prompt, before the call
    # From the start of the process to the first token (None where /proc says nothing): the
    # user's time to first token, measured once, here.
    process_start_to_first_token_s: float | None = None
    token_ids: list = field(default_factory=list)   # the generated ids, as ``text`` decodes

    @property
    def tokens_per_s(self) -> float:
        rest = self.total_s - self.first_token_s
        return (self.new_tokens - 1) / rest if self.new_tokens > 1 and rest > 0 else 0.0


class _Clock:
    """A transformers streamer that only records when tokens arrive."""

    def __init__(self):
        self.calls = 0
        self.first = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt
            self.first = time.perf_counter()

    def end(self):
        pass


def has_tokenizer(path) -> bool:
    """Whether the artifact folder ``path`` carries a tokenizer."""
    from pathlib import Path
    return any((Path(path) / n).is_file() for n in ("tokenizer.json", "tokenizer.model"))


def check_prompt_source(path) -> None:
    """Refuse a prompt for a local artifact without a tokenizer before anything is loaded
    (a Hub address is checked once it is fetched)."""
    from lct.hub import is_hf_uri
    from pathlib import Path
    if not is_hf_uri(str(path)) and (Path(path) / C.MANIFEST_NAME).is_file() and \
            not has_tokenizer(path):
        raise LCTError(f"{path}: the artifact has no tokenizer to encode a prompt", option="ids")


def load_tokenizer(path):
    """The tokenizer stored in the artifact, or ``None`` if it has none."""
    if not has_tokenizer(path):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def check_text_path(model) -> None:
    """Refuse, in one line, a model that cannot generate text from token ids: one whose input
    is not token ids (a speech model's audio features) or that does not generate."""
    name = type(model).__name__
    main = getattr(model, "main_input_name", "input_ids")
    if main != "input_ids":
        raise LCTError(f"{name} takes {main} (not text) as its input: lct load cannot prompt "
                       f"it; the loaded model works from Python (lct.load)", option="prompt")
    can = getattr(model, "can_generate", None)
    if can is not None and not can():
        raise LCTError(f"{name} does not generate text: lct load cannot prompt it; the loaded "
                       f"model works from Python (lct.load)", option="prompt")


def generate_timed(model, path, prompt: str | None = None, ids=None,
                   max_new_tokens: int = 16) -> GenerationResult:
    """Greedy-generate from ``prompt`` (tokenized with the artifact's tokenizer) or token ``ids``.

    Raises:
        LCTError: a prompt was given but the artifact has no tokenizer.
    """
    import torch
    t_tok = time.perf_counter()
    tok = load_tokenizer(path)
    if prompt is not None:
        if tok is None:
            raise LCTError(f"{path}: the artifact has no tokenizer to encode a prompt", option="ids")
        input_ids = tok(prompt, return_tensors="pt").input_ids
        if input_ids.shape[-1] == 0:
            raise LCTError(f"the prompt {prompt!r} encodes to no tokens: give some text, or "
                           f"--ids", option="prompt")
    else:
        ids = list(ids)
        if not ids:
            raise LCTError("no token ids to generate from")
        input_ids = torch.tensor([ids], dtype=torch.long)
    gen = model.model if hasattr(model, "installer") else model
    check_text_path(gen)
    vocab = gen.get_input_embeddings().num_embeddings
    bad = [int(i) for i in input_ids[0] if not 0 <= int(i) < vocab]
    if bad:
        raise LCTError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    input_ids = input_ids.to(gen.device)
    clock = _Clock()
    t0 = time.perf_counter()
    tokenize_s = t0 - t_tok
    try:
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=max_new_tokens, do_sample=False,
                                 streamer=clock,
                                 pad_token_id=getattr(gen.config, "pad_token_id", None) or 0)
    except LCTError:
        raise
    except Exception as e:  # noqa: BLE001 - the model's own forward or generate, in one line
        text = str(e).strip().splitlines()
        raise LCTError(f"the model loaded, but {type(gen).__name__}.generate failed inside "
                       f"transformers ({type(e).__name__}: {text[0][:200] if text else ''}); "
                       f"LCT_DEBUG=1 shows the traceback") from e
    total = time.perf_counter() - t0
    # A decoder-only model returns the prompt and what follows; an encoder-decoder the
    # decoder's tokens from its start token.
    new = out[0, 1:] if getattr(gen.config, "is_encoder_decoder", False) else \
        out[0, input_ids.shape[1]:]
    text = tok.decode(new, skip_special_tokens=True) if tok is not None else " ".join(
        map(str, new.tolist()))
    first = clock.first or (t0 + total)
    from lct.proc import process_age
    age = process_age()
    return GenerationResult(text, int(new.numel()), first - t0, total, first, tokenize_s,
                            None if age is None else age - (time.perf_counter() - first),
                            new.tolist())
