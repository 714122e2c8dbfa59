"""The auto policy: for the embedding and the LM head (a tied table once), measure what each
lossy encoding of the registry would cost, and keep the smallest whose cost fits the budget.

Cost is the mean KL divergence (nats) of the next-token distribution from the lossless model's,
measured one of two ways:

- **calibration** (the default): the source model runs on a text, once as it is and once per
  candidate with that table replaced by its quantized-and-dequantized copy
  (``calibration_costs``). The text is ``--calibration TEXT``, or by default the 256 tokens of
  prose and code shipped with LCT (``sample_text.calibration_samples()``), where the source has a
  tokenizer, gives next-token logits for text alone and fits in memory beside the conversion:
  a layer of it, since it runs layer by layer in float32 (``lct.conversion.layered``), or
  whole where it cannot run so.
- **proxy** (``--calibration none``, and the default's fallback, with the reason in the
  decision's note): the LM head's logits on hidden states drawn from the final norm's
  statistics (``gamma * z + beta``, ``z ~ N(0, I)``, seed ``PROXY_SEED``), lossless against each
  candidate. The embedding gets no cheap measurement of its own: its cost is taken to be that of
  the same relative error in the head (the proxy's error ratio times the head's cost), an upper
  bound on the real-text cost in benchmarks/bench_quality.py (a tied table is counted twice).
  On real models the proxy can be several times off (docs/BENCHMARKS.md, bench_quality).

The costs of the embedding and the head add up to the artifact's cost; among the combinations
whose cost is within the budget, the one with the fewest stored bytes wins (lossless always fits).
A calibration estimate in float32 is held to the budget times its measured error
(``estimate_margin``: the estimate times ``ESTIMATE_MARGIN`` must fit), so that the budget
holds on other text too.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from itertools import product

from lct.conversion.layered import LOGIT_BYTES, ROW_STEP_BYTES
from lct.conversion.layered import Cached as _Cached
from lct.conversion.layered import Swap as _Swap
from lct.conversion.quality import CALIBRATION_MEMORY_SHARE
from lct.errors import CalibrationUnavailable, LCTError, PolicyError
from lct.format import constants as C
from lct.format.encodings import get_encoding, lossy_encodings
from lct.format.layout import encoded_bytes

# The auto policy's settings: the whole artifact's budget for its lossy parts, as a mean KL
# divergence of the next-token distribution in nats (0.01 nats is about +1 % perplexity), and
# how much it measures.
# 0.005: the quality bar LCT holds its default to (about +0.5 % perplexity at most).
DEFAULT_BUDGET_KL = 0.005
DEFAULT_CALIBRATION_TOKENS = 2048
# With no --calibration the policy runs the source model on the calibration text shipped with LCT
# (lct/conversion/sample_text.py, CALIBRATION_*: not the text verify --quality scores), this many
# scored tokens split between its prose and its code, where the model can run on text and fits in
# memory; otherwise, and with --calibration none, it falls back to the text-free proxy.
SHIPPED_CALIBRATION_TOKENS = 256
CALIBRATION_NONE = "none"
# A calibration estimate's measured error: on every real model and text benchmarks/bench_quality.py
# scores, each text's real mean KL (float32) was within this factor of the estimate, either way
# (worst 1.74x above it: Gemma-3-270m's int8_b128 on code). The auto policy keeps a candidate only
# where its estimate times this is within the budget, so that the budget holds on text the
# calibration did not see. The proxy's costs are upper bounds already (1.5-20x over) and get none.
ESTIMATE_MARGIN = 2.0
PROXY_SAMPLES = 64
# The proxy's hidden states come from this seed: not 0, which tiny random test models use.
PROXY_SEED = 7919

log = logging.getLogger(__name__)


@dataclass
class Decision:
    """What the auto policy chose and what it measured."""

    chosen: dict                     # role -> encoding
    tied: bool
    method: str                      # "proxy" or "calibration"
    budget: float
    costs: dict = field(default_factory=dict)    # part -> {encoding: mean KL, nats}
    cost: float = 0.0                # the chosen combination's estimated cost
    tokens: int = 0                  # calibration tokens scored (0 for the proxy)
    seconds: float = 0.0
    mode: str = "auto"               # "manual": the encodings were forced, only measured
    kept: dict = field(default_factory=dict)     # role -> why it stays lossless unmeasured
    sizes: dict = field(default_factory=dict)    # part -> {encoding (and plain): stored bytes}
    note: str = ""                   # which text was measured on, or why none was
    partial: dict = field(default_factory=dict)  # part -> encodings costed by the head alone
    margin: float = 1.0              # what each estimate is multiplied by before the budget

    @property
    def held(self) -> float:
        """The chosen combination's cost as it is held to the budget: the estimate times its
        measured error (``margin``)."""
        return self.cost * self.margin

    def to_dict(self) -> dict:
        return {"method": self.method, "mode": self.mode, "budget_kl": self.budget,
                "cost_kl": round(self.cost, 6),
                "tied": self.tied, "tokens": self.tokens, "seconds": round(self.seconds, 3),
                **({"kept": self.kept} if self.kept else {}),
                **({"sizes": self.sizes} if self.sizes else {}),
                **({"note": self.note} if self.note else {}),
                **({"partial": self.partial} if self.partial else {}),
                **({"margin": self.margin} if self.margin != 1.0 else {}),
                "costs": {p: {e: round(v, 6) if math.isfinite(v) else None
                              for e, v in c.items()} for p, c in self.costs.items()}}

    def summary(self) -> str:
        """One line for ``lct convert``: the choice, its cost, and what the others cost."""
        from lct.units import human
        parts = ["embed+head" if self.tied else r for r in self.costs]
        pick = []
        for part in parts:
            role = "embed" if part == "embed+head" else part
            size = self.sizes.get(part, {})
            low = self.partial.get(part, ())
            other = ", ".join(f"{e} " + ("≥" if e in low else "") + f"{v:.4f}"
                              + (f" {human(size[e])}" if e in size else "")
                              for e, v in self.costs[part].items())
            plain = f", plain {human(size[C.ENCODING_PLAIN])}" if C.ENCODING_PLAIN in size \
                else ""
            pick.append(f"{part} {self.chosen[role]} ({other}{plain})")
        how = self.method + (f"; {self.note}" if self.note else "") + \
            (f", {self.tokens} tokens" if self.tokens else "")
        from lct.io.info import LOWER_BOUND, estimate_against_budget
        est, within = estimate_against_budget(self.cost, self.margin, self.budget)
        legend = LOWER_BOUND if any(self.partial.values()) else ""
        if self.mode == "manual":
            over = not within
            return (f"policy manual ({how}): {'; '.join(pick)}; {est}, "
                    f"{'OVER' if over else 'within'} the budget "
                    f"{self.budget:g}" + (" (the default auto policy keeps within it)"
                                          if over else "") + legend)
        pick += [f"{role} plain ({why})" for role, why in self.kept.items()]
        return f"policy auto ({how}): {'; '.join(pick)}; {est}, budget {self.budget:g}{legend}"


def roundtrip(encoding: str, w, blocksize: int, wf=None):
    """``w`` quantized in ``encoding`` and dequantized again, as float32 (``wf``: ``w`` as
    float32 already, if the caller has it)."""
    return get_encoding(encoding).roundtrip(w, blocksize, wf)


def _kl(ref_logits, logits) -> float:
    from torch.nn import functional as F
    lr, lq = F.log_softmax(ref_logits, -1), F.log_softmax(logits, -1)
    return float((lr.exp() * (lr - lq)).sum(-1).mean())


def head_proxy(w, hidden, candidates, blocksize: int, softcap: float | None = None,
               errors: bool = True) -> tuple:
    """Mean KL of softmax(hidden @ w.T) against each candidate's quantized ``w``, and (with
    ``errors``) each candidate's relative squared error of ``w`` (``||w_q - w||^2 / ||w||^2``).

    Rows of ``w`` are taken a slice at a time, so memory holds the logits and one slice.
    Returns ``({encoding: kl}, {encoding: rel_err2})``.
    """
    import torch
    rows, cols = w.shape
    step = max(1, ROW_STEP_BYTES // (4 * cols))
    ref = torch.empty(hidden.shape[0], rows)
    out = {e: torch.empty(hidden.shape[0], rows) for e in candidates}
    err = {e: 0.0 for e in candidates}
    norm = 0.0
    for r0 in range(0, rows, step):
        piece = w[r0:r0 + step]
        wf = piece.float()
        ref[:, r0:r0 + step] = hidden @ wf.T
        if errors:
            norm += float(wf.pow(2).sum())
        for e in candidates:
            wq = roundtrip(e, piece, blocksize, wf)
            out[e][:, r0:r0 + step] = hidden @ wq.T
            if errors:
                err[e] += float((wq - wf).pow(2).sum())
    if softcap:
        ref = torch.tanh(ref / softcap) * softcap
        out = {e: torch.tanh(v / softcap) * softcap for e, v in out.items()}
    return ({e: _kl(ref, out[e]) for e in candidates},
            {e: err[e] / max(norm, 1e-30) for e in candidates})


def proxy_hidden(gamma, beta, cols: int, samples: int = PROXY_SAMPLES):
    """Hidden states drawn from the final norm's statistics: ``gamma * z + beta``, ``z ~ N(0, I)``
    (an RMS- or LayerNorm output has unit spread per feature before its affine part)."""
    import torch
    gen = torch.Generator().manual_seed(PROXY_SEED)
    z = torch.randn(samples, cols, generator=gen)
    if gamma is not None:
        z = z * gamma.float()
    if beta is not None:
        z = z + beta.float()
    return z


def _final_norm(src, tensors: dict, arch):
    """The final norm's weight (``1 + weight`` where the norm scales so, as Gemma's) and bias
    from the source, or None."""
    from safetensors import safe_open
    found = {}
    for kind, name in arch.final_norm_keys(tensors).items():
        st = tensors[name]
        if len(st.shape) == 1:
            with safe_open(str(src.root / st.file), framework="pt") as f:
                found[kind] = f.get_tensor(name).float()
    gamma = found.get("weight")
    if gamma is not None and arch.plus_one:
        gamma = gamma + 1.0
    return gamma, found.get("bias")


def _table(src, st):
    from safetensors import safe_open
    with safe_open(str(src.root / st.file), framework="pt") as f:
        return f.get_tensor(st.name)


def _candidates(shape, blocksize: int, policy=None, role: str | None = None) -> tuple:
    """The lossy encodings to measure for a table: those that are candidates for its shape (NF4
    where the block size divides its rows); of a manual policy, only the one it forces on
    ``role``, where it fits."""
    if policy is not None and not policy.auto:
        return tuple(e for e in lossy_encodings()
                     if e == policy.forced()[role] and get_encoding(e).fits(shape, blocksize))
    # the registry's lossy encodings as they are now (one registered later is measured too)
    return tuple(e for e in lossy_encodings() if get_encoding(e).candidate(shape, blocksize))


def proxy_costs(src, tensors: dict, lossy: dict, tied: bool, arch, policy) -> dict:
    """Costs per part and candidate by the text-free proxy (see the module docstring)."""
    gamma, beta = _final_norm(src, tensors, arch)
    softcap = getattr(arch.text_config, "final_logit_softcapping", None)
    costs: dict = {}
    head_name = lossy.get("embed") if tied else lossy.get("head")
    embed = None if tied or "embed" not in lossy else _table(src, tensors[lossy["embed"]])
    embed_cands = () if embed is None else \
        _candidates(tuple(embed.shape), policy.blocksize, policy, "embed")
    per_err = None
    if head_name is not None:
        w = _table(src, tensors[head_name])
        cands = _candidates(tuple(w.shape), policy.blocksize, policy, "embed" if tied else "head")
        # the embedding's estimate needs the head's cost per unit of relative error: measure
        # the head in the embedding's candidates too
        measured = tuple(dict.fromkeys(cands + tuple(
            c for c in embed_cands if get_encoding(c).fits(tuple(w.shape), policy.blocksize))))
        hidden = proxy_hidden(gamma if gamma is not None and gamma.numel() == w.shape[1]
                              else None, beta if beta is not None
                              and beta.numel() == w.shape[1] else None, w.shape[1])
        kl, rel_head = head_proxy(w, hidden, measured, policy.blocksize, softcap,
                                  errors=embed is not None)
        del w
        if tied:
            # The table is the head and the embedding: its head cost, plus the same again for
            # the embedding (same relative error, see the module docstring).
            return {"embed+head": {e: 2 * kl[e] for e in cands}}
        costs["head"] = {e: kl[e] for e in cands}
        if measured and embed is not None:
            worst = max(measured, key=kl.get)   # the most costly candidate: the best-measured
            per_err = kl[worst] / max(rel_head[worst], 1e-30)
    if embed is not None:
        if per_err is not None:
            rel = _rel_err(embed, embed_cands, policy.blocksize)
            costs["embed"] = {c: per_err * rel[c] for c in embed_cands}
        else:   # no head to borrow from: the table judged as if it were one
            kl, _ = head_proxy(embed, proxy_hidden(None, None, embed.shape[1]), embed_cands,
                               policy.blocksize, errors=False)
            costs["embed"] = kl
    return costs


def _rel_err(w, candidates, blocksize: int) -> dict:
    """``||w_q - w||^2 / ||w||^2`` per candidate, a row slice at a time."""
    rows, cols = w.shape
    step = max(1, ROW_STEP_BYTES // (4 * cols))
    err = {e: 0.0 for e in candidates}
    norm = 0.0
    for r0 in range(0, rows, step):
        wf = w[r0:r0 + step].float()
        norm += float(wf.pow(2).sum())
        for e in candidates:
            err[e] += float((roundtrip(e, w[r0:r0 + step], blocksize, wf) - wf).pow(2).sum())
    return {e: err[e] / max(norm, 1e-30) for e in candidates}


def calibration_obstacle(src, tensors: dict, arch) -> str | None:
    """Why the shipped calibration text cannot be run through this source here (no tokenizer,
    or a model whose largest layer, in float32, does not fit beside the conversion: the
    layer-wise calibration's need, ``layered_need``), or None."""
    if not any((src.root / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        return "the source has no tokenizer"
    from lct.proc import available_memory
    whole = sum(math.prod(st.shape) * C.DTYPE_SIZES.get(st.dtype, 4) for st in tensors.values())
    need = min(layered_need(tensors, arch), whole)
    avail = available_memory()
    if avail is not None and need > CALIBRATION_MEMORY_SHARE * avail:
        return (f"running the model on text needs {need / 1e9:.1f} GB (its largest layer in "
                f"float32 with the calibration's buffers), more than "
                f"{CALIBRATION_MEMORY_SHARE:.0%} of the {avail / 1e9:.1f} GB of memory available")
    return None


def layered_need(tensors: dict, arch) -> int:
    """Bytes the layer-wise calibration holds at its peak, beyond the process: the largest
    group of the source but the tables (a layer) in float32 twice (read and cast), and the
    head stage's buffers: the logits of the reference and ten candidates on 256 positions (at
    most ``layered.LOGIT_BYTES``), half as much again while they are scored, and two slices of
    the head's rows."""
    groups: dict = {}
    table = vocab = 0
    for name, st in tensors.items():
        group = arch.place(name)[0]
        if group in (C.GROUP_EMBED, C.GROUP_HEAD):
            table = max(table, 4 * math.prod(st.shape))
            vocab = max(vocab, st.shape[0] if st.shape else 1)
            continue
        groups[group] = groups.get(group, 0) + 4 * math.prod(st.shape)
    logits = min(LOGIT_BYTES, 4 * SHIPPED_CALIBRATION_TOKENS * vocab * 11)
    return 2 * max(groups.values(), default=0) + logits * 3 // 2 + 2 * min(ROW_STEP_BYTES, table)


def calibration_costs(src, tensors: dict, lossy: dict, tied: bool, arch, policy,
                      progress=None, layered: bool | None = None) -> tuple:
    """Costs per part and candidate measured on text (``policy.calibration``, or the text shipped
    with LCT, ``sample_text.calibration_samples()``), as mean KL against the source model on the
    same tokens.

    The model runs once per block as it is (the reference), keeping its trunk's output. A head
    candidate reruns only what follows the trunk (the head and any logit soft-cap) on that kept
    output, with the head's weight quantized-and-dequantized; an embedding candidate reruns the
    whole model with the embedding's weight so. A tied table's cost is the sum of both, each
    measured alone. The whole passes are the cost of calibration, so for a tied table of an auto
    policy the candidates go smallest first and the embedding is measured only where it can
    change the choice: not once a smaller candidate fits the budget (``policy.budget`` over
    ``ESTIMATE_MARGIN``, as ``decide`` holds an estimate to it), nor where the head alone is
    over it. Such a candidate's cost is its head's, a lower bound, and it is listed in
    the returned ``partial``.

    The model computes in float32 where it fits in ``CALIBRATION_MEMORY_SHARE`` of the
    memory available so (``quality.compute_dtype``), else in the source's dtype: the budget is
    what the storage costs, and in bfloat16 the trunk's own rounding turns any change of the
    table into about as much KL as int8 costs (docs/BENCHMARKS.md, bench_quality).

    ``progress``, if given, is called as ``progress(what, tokens_done, tokens_total)`` after each
    pass of the model over a block of the text, and as a candidate's round trip starts: the
    tokens are those run through the model (the reference once, each candidate's head and
    embedding once each); ``what`` names the candidate and the part (``"NF4 on embed+head:
    head"``). A pass pruned as above is taken off the total.

    By default (``layered`` None) the model runs layer by layer, always in float32
    (``lct.conversion.layered.layerwise_costs``: the same costs within 1e-4 on the two real
    models benchmarks/bench_calibration.py measures, faster than the whole model and with a
    peak that does not grow with the model); a model that cannot run so (not one stack of
    decoder layers under a base model), and ``layered=False``, runs whole as described above,
    where it fits in the memory available in the source's dtype.

    Returns ``(costs, tokens scored, partial, dtype, layered)``: ``partial`` is ``{part:
    [encodings]}``, ``dtype`` the name of what the model computed in, ``layered`` whether it
    ran layer by layer.

    Raises:
        CalibrationUnavailable: the model has no tokenizer, or cannot be run on text.
    """
    import torch
    from torch.nn import functional as F
    from transformers import AutoTokenizer

    from lct.conversion import sample_text
    from lct.conversion.quality import DEFAULT_BLOCK, compute_dtype, read_texts, token_blocks
    from lct.io.reader import torch_dtype
    if not any((src.root / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        raise CalibrationUnavailable(f"{src.root}: a calibration text needs the model's "
                                     f"tokenizer, and the source has none")
    shipped = policy.calibration is None
    texts = sample_text.calibration_samples() if shipped else read_texts(policy.calibration)
    limit = SHIPPED_CALIBRATION_TOKENS if shipped else policy.max_calibration_tokens
    blocks = token_blocks(AutoTokenizer.from_pretrained(src.root), texts, limit, DEFAULT_BLOCK,
                          spread=shipped)
    if not blocks:
        raise PolicyError(f"{policy.calibration}: the text is shorter than two tokens")
    if layered is not False:
        from lct.conversion import layered as lw
        plan = {}
        for part, roles in ({"embed+head": ("embed", "head")} if tied else
                            {r: (r,) for r in lossy if r in ("embed", "head")}).items():
            st = tensors[lossy[roles[0]]]
            shape = tuple(st.shape)
            order = _candidates(shape, policy.blocksize, policy, "embed" if tied else roles[0])
            plan[part] = (roles, st, order, sorted(order, key=lambda e: encoded_bytes(
                e, shape, st.dtype, policy.blocksize)))
        sweep = sum(len(ids) for ids in blocks)
        passes = _Passes(progress, sweep * (1 + sum(len(cands) * len(roles)
                                                    for roles, _, _, cands in plan.values())))
        try:
            costs, n, partial = lw.layerwise_costs(
                src, tensors, type(arch.model), plan, blocks, policy.blocksize,
                policy.budget / estimate_margin("calibration", "float32"),
                tied and policy.auto, passes)
            return costs, n, partial, "float32", True
        except CalibrationUnavailable as e:
            from lct.proc import available_memory
            need = sum(math.prod(st.shape) * C.DTYPE_SIZES.get(st.dtype, 4)
                       for st in tensors.values())
            avail = available_memory()
            if layered:
                raise
            if avail is not None and need > CALIBRATION_MEMORY_SHARE * avail:
                raise CalibrationUnavailable(
                    f"{e}; whole, the model ({need / 1e9:.1f} GB) is more than "
                    f"{CALIBRATION_MEMORY_SHARE:.0%} of the {avail / 1e9:.1f} GB of memory "
                    f"available") from e
    native = torch_dtype(tensors[next(iter(lossy.values()))].dtype)
    params = sum(math.prod(st.shape) for st in tensors.values())
    dtype = compute_dtype(params, 1, CALIBRATION_MEMORY_SHARE) or native
    name = str(dtype).removeprefix("torch.")
    try:
        model = type(arch.model).from_pretrained(src.root, dtype=dtype).eval()
    except (OSError, ValueError, TypeError, RuntimeError) as e:
        raise CalibrationUnavailable(f"{src.root}: transformers could not load the model to "
                                     f"run it on text ({e})") from e
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    rows = getattr(embed, "num_embeddings", None)
    top = max(max(ids) for ids in blocks)
    if isinstance(rows, int) and top >= rows:
        raise CalibrationUnavailable(f"{src.root}: its tokenizer gives token id {top}, past the "
                                     f"model's {rows}-row embedding: the tokenizer does not "
                                     f"match the model")
    parts = {"embed+head": ("embed", "head")} if tied else \
        {r: (r,) for r in lossy if (embed if r == "embed" else head) is not None}
    base = model.base_model if model.base_model is not model else None

    def logits(x):
        out = model(x)
        lg = getattr(out, "logits", None)
        if lg is None or lg.dim() != 3:
            raise CalibrationUnavailable(f"{src.root}: the model gives no next-token logits "
                                         f"for text alone ({type(model).__name__})")
        return F.log_softmax(lg[0, :-1].float(), -1)

    # What the passes will run, for ``progress``: the candidates of each part, in the order
    # they are measured (smallest first), and the model's passes over the text in tokens.
    plan = {}
    for part, roles in parts.items():
        p = (embed if roles[0] == "embed" else head).weight.detach()
        shape, dtype_name = tuple(p.shape), tensors[lossy[roles[0]]].dtype
        order = _candidates(shape, policy.blocksize, policy, "embed" if tied else roles[0])
        plan[part] = (roles, p, dtype_name, order, sorted(
            order, key=lambda e: encoded_bytes(e, shape, dtype_name, policy.blocksize)))
    sweep = sum(len(ids) for ids in blocks)
    passes = _Passes(progress, sweep * (1 + sum(len(cands) * len(roles)
                                                for roles, _, _, _, cands in plan.values())))
    passes.say("the source model as it is (the reference)")
    refs = []
    with torch.no_grad():
        for ids in blocks:
            x = torch.tensor([ids])
            kept = []
            hook = base.register_forward_hook(lambda m, i, o: kept.append(o)) if base else None
            try:
                lr = logits(x)
            except CalibrationUnavailable:
                raise
            except Exception as e:     # noqa: BLE001  a model that cannot run on text alone
                raise CalibrationUnavailable(f"{src.root}: the model could not run on text "
                                             f"({type(e).__name__}: {e})") from e
            finally:
                if hook is not None:
                    hook.remove()
            refs.append((x, lr, kept[0] if len(kept) == 1 else None))
            passes.ran("the source model as it is (the reference)", len(ids))
        # The trunk's kept output gives the reference logits again, or the head reruns whole.
        x, lr, out = refs[0]
        if out is not None:
            with _Cached(base, out):
                if not torch.equal(logits(x), lr):
                    refs = [(x, lr, None) for x, lr, _ in refs]
        n = sum(len(x[0]) - 1 for x, _, _ in refs)

        def kl(role_module, wq, cached: bool, what: str) -> float:
            total = 0.0
            with _Swap(role_module, wq):
                for x, lr, out in refs:
                    if cached and out is not None:
                        with _Cached(base, out):
                            lq = logits(x)
                    else:
                        lq = logits(x)
                    total += float((lr.exp() * (lr - lq)).sum())
                    passes.ran(what, x.shape[1])
            return total / n

        costs: dict = {}
        partial: dict = {}
        for part, (roles, p, dtype_name, order, cands) in plan.items():
            prune = tied and policy.auto
            bound = policy.budget / estimate_margin("calibration", name)
            c, fits = {}, False
            stored = p.to(torch_dtype(dtype_name))  # the stored values (from float32: exact)
            wf = p if p.dtype == torch.float32 else None
            for e in cands:                     # one round trip per candidate
                what = f"{get_encoding(e).label} on {part}"
                passes.say(f"{what}: quantizing")
                wq = roundtrip(e, stored, policy.blocksize, wf).to(p.dtype)
                c[e] = kl(head, wq, True, f"{what}: head") if "head" in roles else 0.0
                if "embed" in roles:
                    if prune and (fits or not c[e] <= bound):
                        partial.setdefault(part, []).append(e)
                        passes.skip(f"{what}: embed left out (cannot change the choice)",
                                    sweep)
                    else:
                        c[e] += kl(embed, wq, False, f"{what}: embed (whole model)")
                        fits = fits or c[e] <= bound
                del wq
            del stored, wf
            costs[part] = {e: c[e] for e in order}      # in the registry's order
    return costs, n, partial, name, False


class _Passes:
    """The calibration's progress in tokens run through the model, told to ``progress(what,
    done, total)`` (nothing without one)."""

    def __init__(self, progress, total: int):
        self.progress, self.done, self.total = progress, 0, total

    def ran(self, what: str, tokens: int) -> None:
        """A pass over ``tokens`` tokens, for ``what``, is done."""
        self.done += tokens
        self.say(what)

    def skip(self, what: str, tokens: int) -> None:
        """Passes over ``tokens`` tokens counted in the total will not run (``what``: pruned)."""
        self.total -= tokens
        self.say(what)

    def say(self, what: str) -> None:
        if self.progress is not None:
            self.progress(what, self.done, self.total)


def estimate_margin(method: str, dtype: str | None) -> float:
    """What an estimate of ``method`` computed in ``dtype`` (a name: ``"float32"``) is multiplied
    by before it is held to the budget: ``ESTIMATE_MARGIN`` for a calibration in float32, where it was measured;
    1 for one in bfloat16 or float16 (the compute's own rounding makes it larger than the
    storage's float32 cost: 1.2-3.5x on the benchmarked models) and for the proxy (an upper
    bound, 1.5-20x over)."""
    return ESTIMATE_MARGIN if method == "calibration" and dtype == "float32" else 1.0


def choose(costs: dict, shapes: dict, dtypes: dict, budget: float, blocksize: int) -> tuple:
    """The combination of encodings with the fewest stored bytes whose summed cost fits
    ``budget``: ``({role: encoding}, cost)``. ``shapes``/``dtypes`` are per part."""
    parts = list(costs)
    options = [[(C.ENCODING_PLAIN, 0.0)] + list(costs[p].items()) for p in parts]
    best = None
    for combo in product(*options):
        cost = sum(c for _, c in combo)
        if not cost <= budget:      # a NaN cost (non-finite logits) is not within the budget
            continue
        size = sum(encoded_bytes(e, shapes[p], dtypes[p], blocksize)
                   for p, (e, _) in zip(parts, combo))
        if best is None or (size, cost) < best[0]:
            best = ((size, cost), combo)
    chosen = {r: C.ENCODING_PLAIN for r in C.LOSSY_ROLES}
    for p, (e, _) in zip(parts, best[1]):
        if p == "embed+head":
            chosen["embed"] = chosen["head"] = e
        else:
            chosen[p] = e
    return chosen, best[0][1]


def decide(src, tensors: dict, lossy: dict, tied: bool, arch, policy,
           progress=None) -> Decision:
    """Choose the encodings of the embedding and the head (see the module docstring).

    Args:
        src: the resolved source; ``tensors``: its ``{name: SourceTensor}``.
        lossy: ``{role: tensor name}`` of the candidate tables.
        tied: the embedding and the head are one stored table.
        arch: the model's ``lct.arch.model.Architecture`` (its final norm).
        policy: the converter's ``Policy`` (budget, blocksize, calibration text).
        progress: called as ``progress(what, tokens_done, tokens_total)`` while a calibration
            runs the model on its text (``calibration_costs``); the proxy reports nothing.

    Returns:
        The ``Decision``; its ``seconds`` is the time the measurement took.

    Raises:
        PolicyError: calibration text or tokenizer missing.
    """
    t0 = time.perf_counter()
    kept = _non_finite(src, tensors, lossy, policy)
    lossy = {r: n for r, n in lossy.items() if r not in kept}
    if not lossy:
        return Decision({r: C.ENCODING_PLAIN for r in C.LOSSY_ROLES}, tied, "none",
                        policy.budget, kept=kept)
    note, partial, dtype = "", {}, None
    if policy.calibration == CALIBRATION_NONE:
        costs, tokens, method = proxy_costs(src, tensors, lossy, tied, arch, policy), 0, "proxy"
    else:
        try:
            why = None if policy.calibration else calibration_obstacle(src, tensors, arch)
            if why:
                raise CalibrationUnavailable(why)
            costs, tokens, partial, dtype, layered = calibration_costs(
                src, tensors, lossy, tied, arch, policy, progress)
            method = "calibration"
            note = ("LCT's calibration text (lct/conversion/sample_text.py)"
                    if not policy.calibration else "the text given") + f", in {dtype}"
            if dtype != "float32":
                note += (" (float32 would not fit in memory; the estimate holds the "
                         "compute's own rounding)")
            elif layered:
                note += ", layer by layer"
        except CalibrationUnavailable as e:
            if policy.calibration:
                raise
            costs, tokens, method = proxy_costs(src, tensors, lossy, tied, arch, policy), 0, \
                "proxy"
            note = f"no calibration: {e}"
        except (OSError, ValueError) as e:
            raise LCTError(f"{src.root}: could not run the model on the calibration text "
                           f"({e})") from e
    costs = {part: c for part, c in costs.items() if c}
    if method == "calibration" and costs and \
            all(not math.isfinite(v) for c in costs.values() for v in c.values()):
        # NaN logits (a NaN or inf weight in a layer): no cost is within any budget, so every
        # table stays lossless; say why, or the summary reads as if nothing were measured
        note += ("; the model's logits on it are not finite (a weight of the source is "
                 "not, or its dtype overflows), so nothing lossy could be measured: kept "
                 "lossless")
    log.info("%s costs (mean KL, nats): %s", method, costs)
    margin = estimate_margin(method, dtype)
    shapes, dtypes = {}, {}
    for part in costs:
        st = tensors[lossy["embed" if part == "embed+head" else part]]
        shapes[part], dtypes[part] = tuple(st.shape), st.dtype
    if policy.auto:
        chosen, cost = choose(costs, shapes, dtypes, policy.budget / margin, policy.blocksize)
    else:
        chosen = policy.forced()
        cost = sum(c.get(chosen["embed" if p == "embed+head" else p], 0.0)
                   for p, c in costs.items())
    sizes = {part: {e: encoded_bytes(e, shapes[part], dtypes[part], policy.blocksize)
                    for e in (C.ENCODING_PLAIN, *c)} for part, c in costs.items()}
    return Decision(chosen, tied, method, policy.budget, costs, cost, tokens,
                    time.perf_counter() - t0, "auto" if policy.auto else "manual", kept,
                    sizes, note, partial, margin)


def _non_finite(src, tensors: dict, lossy: dict, policy) -> dict:
    """``{role: reason}`` of the candidate tables holding a NaN or an Inf, which no lossy
    encoding keeps (lossless keeps them bit for bit): the auto policy leaves them lossless and
    says so; a policy that forces a lossy encoding on one is refused, naming the tensor."""
    import torch
    out = {}
    for role, name in lossy.items():
        st = tensors[name]
        if st.dtype not in C.FLOAT_DTYPES or bool(torch.isfinite(_table(src, st)).all()):
            continue
        forced = None if policy.auto else policy.forced().get(role)
        if forced not in (None, C.ENCODING_PLAIN):
            raise PolicyError(f"{src.root / st.file}: tensor {name!r} holds NaN or Inf values, "
                              f"which {get_encoding(forced).label} cannot encode; keep it "
                              f"lossless", option=forced)
        out[role] = "holds NaN/Inf: kept lossless, bit for bit"
    return out
