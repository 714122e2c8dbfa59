"""What an artifact's lossy parts cost on real text: perplexity of the loaded artifact and of a
lossless reference (the source checkpoint), their difference, how often the most likely next
token agrees, and the KL divergence of the next-token distributions.

Text is cut into non-overlapping blocks of ``block`` tokens (tokenised with the artifact's
tokenizer); every position but a block's first is scored. Perplexity is exp of the mean negative
log-likelihood of the true next token; KL is ``sum p_ref * (log p_ref - log p)`` per position.
Each model's trunk runs once per block; its head (and what follows it, a logit soft-cap) runs
on ``SCORE_POSITIONS`` positions at a time, so that the logits of a large vocabulary are never
held for a whole block (512 positions of a 262k vocabulary are 0.5 GB a tensor in float32).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lct.conversion.freq import TEXT_SUFFIXES
from lct.errors import LCTError

DEFAULT_MAX_TOKENS = 4096
DEFAULT_BLOCK = 512
SCORE_POSITIONS = 128       # positions whose logits exist at once (score)
# A model is loaded whole to be measured (the auto policy's calibration, verify --quality) in
# float32 only when its bytes are at most this share of the memory available (the rest: the
# converter's own buffers, the candidates' round trips).
CALIBRATION_MEMORY_SHARE = 0.5


@dataclass
class QualityReport:
    """Scores of the artifact (``ppl``) against the lossless reference (``ppl_reference``)."""

    texts: list = field(default_factory=list)   # names of the texts scored
    blocks: int = 0
    tokens: int = 0                 # scored next-token positions
    ppl_reference: float = 0.0
    ppl: float = 0.0
    top1_agreement: float = 0.0     # share of positions whose argmax equals the reference's
    kl_mean: float = 0.0            # nats
    kl_max: float = 0.0
    budget_kl: float | None = None  # the budget the mean KL is held to (verify sets it)
    dtype: str = ""                 # what both models computed in ("float32", "bfloat16", ...)

    @property
    def delta_pct(self) -> float:
        """Perplexity change against the reference, in percent."""
        return (self.ppl / self.ppl_reference - 1.0) * 100.0 if self.ppl_reference else 0.0

    @property
    def within_budget(self) -> bool | None:
        """Whether the mean KL is within ``budget_kl`` (a NaN is not); None without a budget."""
        if self.budget_kl is None:
            return None
        return bool(self.kl_mean <= self.budget_kl)

    def verdict(self) -> str:
        """One line: the mean KL against the budget, ``within`` or ``OVER``."""
        rounding = " (the compute's own rounding counts too; --layerwise scores in float32)" \
            if self.dtype and self.dtype != "float32" else ""
        return (f"mean KL {self.kl_mean:.5f} nats on {self.tokens} tokens"
                + (f" in {self.dtype}" if self.dtype else "") + rounding + ": "
                f"{'within' if self.within_budget else 'OVER'} the budget {self.budget_kl:g}")

    def to_dict(self) -> dict:
        return {**asdict(self), "delta_pct": self.delta_pct,
                "within_budget": self.within_budget}


def read_texts(path) -> list:
    """``[(name, text)]`` from a text file, or every text file under a folder (sorted)."""
    p = Path(path)
    if p.is_file():
        files = [p]
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
    else:
        raise LCTError(f"{p}: no such text file or folder")
    out = [(str(f), f.read_text(encoding="utf-8", errors="replace")) for f in files]
    out = [(n, t) for n, t in out if t.strip()]
    if not out:
        raise LCTError(f"{p}: no text to score (looked for {', '.join(TEXT_SUFFIXES)})")
    return out


def token_blocks(tokenizer, texts: list, max_tokens: int, block: int,
                 spread: bool = False) -> list:
    """Token id lists of at most ``block`` ids, ``max_tokens`` scored positions in all: from the
    texts in order, or (``spread``) an equal share of them from each text."""
    if block < 2:
        raise LCTError(f"block {block} must be at least 2 tokens")
    if spread and len(texts) > 1:
        share = max(1, max_tokens // len(texts))
        return [b for t in texts for b in token_blocks(tokenizer, [t], share, block)]
    blocks, scored = [], 0
    for _, text in texts:
        ids = tokenizer(text).input_ids
        for i in range(0, len(ids), block):
            piece = ids[i:i + block]
            room = max_tokens - scored
            if room <= 0:
                return blocks
            piece = piece[: room + 1]
            if len(piece) >= 2:
                blocks.append(piece)
                scored += len(piece) - 1
    return blocks


def score(model, reference, blocks: list, progress=None,
          positions: int = SCORE_POSITIONS) -> dict:
    """Sums over ``blocks`` of both models' next-token statistics (see the module docstring),
    computed from the logits of ``positions`` positions at a time."""
    import torch
    from torch.nn import functional as F
    sums = {"nll": 0.0, "nll_ref": 0.0, "agree": 0, "kl": 0.0, "kl_max": 0.0, "n": 0}
    with torch.no_grad():
        for i, ids in enumerate(blocks):
            x = torch.tensor([ids])
            target = x[0, 1:]
            ours = _Logits(model, x)
            # a reference that scores itself (layered.SourceTrunk: the source layer by layer)
            theirs = reference.scorer(x) if hasattr(reference, "scorer") else \
                _Logits(reference, x)
            # slices of every position, the last one's (which scores nothing) in the last slice:
            # a block of ``positions`` or fewer runs its head as the whole forward does
            for p0 in range(0, x.shape[1], positions):
                at = torch.arange(p0, min(p0 + positions, x.shape[1]))
                k = min(len(at), target.numel() - p0)
                if k <= 0:                  # that last position alone: nothing to score
                    break
                lp = F.log_softmax(ours(at)[:k].float(), dim=-1)
                lr = F.log_softmax(theirs(at)[:k].float(), dim=-1)
                t = target[p0:p0 + k][:, None]
                sums["nll"] += -lp.gather(1, t).sum().item()
                sums["nll_ref"] += -lr.gather(1, t).sum().item()
                sums["agree"] += int((lp.argmax(-1) == lr.argmax(-1)).sum())
                kl = (lr.exp() * (lr - lp)).sum(-1)
                sums["kl"] += kl.sum().item()
                sums["kl_max"] = max(sums["kl_max"], kl.max().item())
                del lp, lr, kl
            sums["n"] += target.numel()
            if progress:
                progress(f"block {i + 1}", i + 1, len(blocks))
    return sums


class _Logits:
    """The logits of ``model`` (a transformers causal LM, or a ``LayerwiseModel``, whose
    ``.model`` is one) on ids ``x`` [1, T], for the positions asked at each call: the model's
    own forward with ``logits_to_keep`` (transformers' way to run the head on some positions),
    its trunk run once and its output kept for the next calls (as the calibration keeps it,
    ``lct.conversion.policy``). A model whose trunk cannot be kept runs whole on each call; one
    whose forward takes no ``logits_to_keep`` gives all its logits once, sliced."""

    def __init__(self, model, x):
        import inspect

        import torch
        self.hf = model if isinstance(model, torch.nn.Module) else model.model
        self.x, self.kept, self.whole = x, None, None
        base = self.hf.base_model
        self.base = base if base is not self.hf else None
        if "logits_to_keep" not in inspect.signature(self.hf.forward).parameters:
            self.whole = self.hf(x).logits[0]

    def __call__(self, at):
        if self.whole is not None:
            return self.whole[at]
        if self.kept is not None:
            kept, own = self.kept, vars(self.base).get("forward")   # a forward set on it
            self.base.forward = lambda *a, **k: kept
            try:
                # forward, not the call: the model's own hooks (a LayerwiseModel's, which
                # start streaming its layers) are for a pass that runs the trunk
                return self.hf.forward(self.x, logits_to_keep=at).logits[0]
            finally:
                if own is None:
                    del self.base.forward
                else:
                    self.base.forward = own
        seen: list = []
        hook = self.base.register_forward_hook(lambda m, i, o: seen.append(o)) \
            if self.base is not None else None
        try:
            logits = self.hf(self.x, logits_to_keep=at).logits[0]
        finally:
            if hook is not None:
                hook.remove()
        if len(seen) == 1:
            self.kept = seen[0]
        return logits


def compute_dtype(params: int, copies: int, share: float):
    """What a KL of the storage is computed in: ``torch.float32`` where ``copies`` models of
    ``params`` parameters fit in float32 within ``share`` of the memory available, else None
    (the model's own dtype; also where the memory available cannot be read). float32 leaves
    the compute's own rounding out of a KL, so that it measures what the storage costs.

    Example:
        >>> compute_dtype(270_000_000, 2, 0.5)      # on a machine with 24 GB free
        torch.float32
    """
    import torch

    from lct.proc import available_memory
    avail = available_memory()
    return torch.float32 if avail is not None and 4 * params * copies <= share * avail \
        else None


def measure_quality(artifact, against: str, *, revision: str | None = None, text=None,
                    max_tokens: int = DEFAULT_MAX_TOKENS, block: int = DEFAULT_BLOCK,
                    progress=None, layerwise: bool = False, dtype=None) -> QualityReport:
    """Score the loaded ``artifact`` (as ``lct.load`` gives it: lossy parts kept) against the
    source ``against`` loaded with ``from_pretrained``, on ``text`` (a file or folder; default:
    the sample in ``lct.conversion.sample_text``), both computing in ``dtype`` (a torch dtype).
    By default float32, what the conversion's budget is measured in, where both models fit in
    memory so (layer-wise, always), else the artifact's dtype. In bfloat16 the KL holds the
    compute's own rounding as well as the storage's: on a model whose logits are that
    sensitive, any change of the weights costs about as much (docs/BENCHMARKS.md); float32
    measures what the storage costs alone. The report's ``dtype`` says which.

    With ``layerwise`` neither model is ever whole in memory: the artifact runs as a
    ``LayerwiseModel`` (layers streamed on every forward, its tables as the artifact stores
    them), and the reference is the source itself run layer by layer from its safetensors
    files (``lct.conversion.layered.SourceTrunk``: one layer at a time, the embedding's rows of
    the block's tokens and the head a slice of rows at a time, never a table whole), so that
    the peak is the artifact's tables, a layer and the prefetch window (docs/CONVERT.md).

    Raises:
        LCTError: the artifact has no tokenizer, no text, or the source cannot be resolved.
    """
    from transformers import AutoTokenizer

    from lct.conversion import sample_text
    from lct.conversion.source import resolve
    from lct.loader import load
    path = Path(artifact)
    if not any((path / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        raise LCTError(f"{path}: the artifact has no tokenizer to cut the text into tokens")
    texts = read_texts(text) if text is not None else sample_text.samples()
    tokenizer = AutoTokenizer.from_pretrained(path)
    src = resolve(against, revision)
    block = min(block, _max_positions(src.config) or block)
    if dtype is None:
        import torch

        from lct.io.reader import open_artifact
        with open_artifact(path, verify=False) as art:
            params = sum(math.prod(t.shape) for t in art.manifest.tensors.values())
        dtype = torch.float32 if layerwise else \
            compute_dtype(params, 2, CALIBRATION_MEMORY_SHARE)
    if layerwise:
        from lct.conversion.layered import SourceTrunk
        from lct.conversion.source import scan
        from lct.loader.layerwise import LayerwiseModel
        with LayerwiseModel(path, dtype=dtype) as model, \
                SourceTrunk(src, scan(src), type(model.model), dtype=dtype) as reference:
            report = compare(model, reference, tokenizer, texts, max_tokens=max_tokens,
                             block=block, progress=progress)
            report.dtype = _dtype_name(model.model)
            return report
    model = load(path, dtype=dtype)
    first = next(p for p in model.parameters() if p.is_floating_point())
    # the class the artifact builds (a vision-language or encoder-decoder one included), so
    # that both sides are the same model
    reference = type(model).from_pretrained(src.root, dtype=first.dtype).eval()
    try:
        report = compare(model, reference, tokenizer, texts, max_tokens=max_tokens,
                         block=block, progress=progress)
    except (LCTError, MemoryError):
        raise
    except Exception as e:      # noqa: BLE001 - a model that cannot run on text alone
        line = (str(e).strip().splitlines() or [""])[0][:200]
        raise LCTError(f"{path}: --quality scores next-token predictions on text, and "
                       f"{type(model).__name__} could not run on text alone "
                       f"({type(e).__name__}: {line}); the tensor checks (lct verify --against) "
                       f"hold for it") from e
    report.dtype = _dtype_name(model)
    return report


def _max_positions(config: dict) -> int | None:
    """The longest sequence the (text) model of config.json ``config`` takes, where it says
    (BART's learned position table fails past it), else None: no block is scored longer."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    for key in ("max_position_embeddings", "n_positions"):
        n = text.get(key)
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            return n
    return None


def _dtype_name(model) -> str:
    """The dtype ``model``'s floating-point parameters compute in, as ``"float32"``."""
    first = next(p for p in model.parameters() if p.is_floating_point())
    return str(first.dtype).removeprefix("torch.")


def compare(model, reference, tokenizer, texts: list, *, max_tokens: int = DEFAULT_MAX_TOKENS,
            block: int = DEFAULT_BLOCK, progress=None) -> QualityReport:
    """Score loaded ``model`` against loaded ``reference`` on ``texts`` (``[(name, text)]``),
    tokenized with ``tokenizer`` (see the module docstring).

    Raises:
        LCTError: ``max_tokens`` below 1, or text shorter than two tokens.
    """
    if max_tokens < 1:
        raise LCTError(f"max tokens {max_tokens} must be at least 1")
    blocks = token_blocks(tokenizer, texts, max_tokens, block)
    if not blocks:
        raise LCTError("the text is shorter than two tokens: nothing to score")
    sums = score(model, reference, blocks, progress)
    n = sums["n"]
    return QualityReport(texts=[name for name, _ in texts], blocks=len(blocks), tokens=n,
                         ppl_reference=math.exp(sums["nll_ref"] / n), ppl=math.exp(sums["nll"] / n),
                         top1_agreement=sums["agree"] / n, kl_mean=sums["kl"] / n,
                         kl_max=sums["kl_max"])
