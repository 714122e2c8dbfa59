"""The memory planner: what a model needs in memory for inference or a training step, read from its
``config.json`` alone (no weights are downloaded or read).

Exact figures (tested against the real thing): parameter counts (``sum(p.numel())`` of the
transformers model built from the same config), weight bytes in every precision, LCT's decoded
bytes (NF4 codes + absmax + 64-byte alignment, laid out by the format's own ``layout_group``),
optimizer states of torch AdamW / SGD, transformers' Adafactor and bitsandbytes' AdamW8bit,
gradients, master weights, the KV cache that transformers' ``DynamicCache`` holds after a forward
of S tokens, and the activations a training forward saves for backward (on CPU kernels).

Estimates (documented in docs/PLAN.md, measured by benchmarks/bench_plan.py): the temporaries of
an inference forward, the logits and loss buffers, optimizer-step temporaries, and the peak of a
training step, which is the largest of five moments
(end of forward, start of backward, LM-head backward, end of backward, optimizer step) rather
than a sum of everything: gradients and activations do not peak together.

Example:
    >>> from lct.plan.memory import plan
    >>> p = plan("google/gemma-2b", mode="train", batch=4, seq=2048, precision="mixed")
    >>> p.params, p.total, p.fits
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from lct.errors import PlanError
from lct.format import constants as C
from lct.format.encodings import get_encoding, is_lossy
from lct.format.layout import encoded_bytes
from lct.format.maximus import default_budget, shard_bounds
from lct.format.nf4 import encoded_size
from lct.plan.modelspec import Dims, model_dims, parameter_specs, read_config
from lct.plan.options import (  # noqa: F401 - the planner's option names, re-exported
    DEFAULT_LOSS_CHUNK,
    DEFAULT_SEQ,
    DEVICES,
    DTYPE_PRECISION,
    FORMATS,
    KV_DTYPES,
    MODES,
    OPTIMIZERS,
    PRECISION_DTYPE,
    PRECISIONS,
    PlanOptions,
    default_device,
    parse_bytes,
    parse_resident,
)
from lct.units import human

PARTS = ("embedding", "pos_embedding", "layers", "norm", "head", "other")
ROLE_PART = {"embed": "embedding", "pos_embed": "pos_embedding", "layer": "layers", "norm": "norm",
             "head": "head", "misc": "other"}
# MaximusEmbedding's default: a quarter of 32 shards resident (K, N).
DEFAULT_MAXIMUS = (default_budget(C.DEFAULT_MAXIMUS_SHARDS), C.DEFAULT_MAXIMUS_SHARDS)
# bitsandbytes 8-bit optimizers: tensors under 4096 elements keep fp32 states; blockwise absmax
# per 256 elements; two 256-entry float32 quantization maps shared by all tensors.
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCKSIZE = 256
BNB_QMAP_BYTES = 2 * 256 * 4


nf4_bytes = encoded_size     # bytes of an NF4 tensor (lct.format.nf4 holds the formula)
# What a plan assumes of a model that is not an artifact, asked for no encoding: the embedding
# and the head in int8, what the auto policy picks for the trained models measured in
# docs/BENCHMARKS.md.
DEFAULT_ENCODING = C.ENCODING_INT8


def lct_layout(specs: list, dtype: str, encodings: dict | None = None,
               blocksize: int = C.DEFAULT_BLOCKSIZE,
               maximus_shards: int | None = None) -> dict:
    """How LCT's converter lays ``specs`` out: ``{name: (tensor_bytes, decoded_bytes)}``.

    ``encodings`` is ``{role: lossy encoding}`` for the 2-D embedding and head tables (default:
    both NF4); the others are plain, in ``dtype``. ``decoded_bytes`` is the tensor's span in its
    decoded chunk (codes, scales and the 64-byte alignment gaps up to the next tensor), so the
    spans of a group add up to its chunks' ``decoded_size`` exactly; it comes from the format's
    own ``layout_group`` over the tensors in the order the converter meets them (safetensors
    keys are sorted).

    Raises:
        PlanError: a table's rows do not suit its encoding (the NF4 block size does not divide
            a row, a Q8_0 row is not whole blocks): the converter would refuse it.
    """
    from lct.format.layout import TensorSpec, layout_group

    encodings = {r: C.ENCODING_NF4 for r in C.LOSSY_ROLES} if encodings is None else encodings
    by_group: dict = {}
    pieced = []
    table_shape = next((s.shape for s in specs if s.role == "embed"), None)
    for s in sorted(specs, key=lambda s: s.name):
        enc = encodings.get(s.role, C.ENCODING_PLAIN) if len(s.shape) == 2 else \
            C.ENCODING_PLAIN
        e = get_encoding(enc)
        if e.lossy and not e.fits(tuple(s.shape), blocksize):
            raise PlanError(f"{e.label} cannot store {s.name} {list(s.shape)}"
                            + (f" with blocksize {blocksize}" if e.blocked else "")
                            + "; lct convert would refuse it (pass another "
                            + ("blocksize, or " if e.blocked else "") + f"{enc}=())")
        spec = TensorSpec(s.name, s.shape, dtype, e.stored_dtype(dtype), enc, s.role, s.group,
                          blocksize if e.blocked else None)
        if maximus_shards and s.role in ("embed", "head") and s.shape == table_shape:
            pieced.append(spec)
        else:
            by_group.setdefault(s.group, []).append(spec)
    layouts = [p for g, group_specs in by_group.items() for p in layout_group(g, group_specs)]
    for spec in pieced:
        bounds = shard_bounds(spec.shape[0], min(maximus_shards, spec.shape[0]))
        for r0, r1 in zip(bounds, bounds[1:]):
            if r1 == r0:
                continue  # an empty trailing shard holds no bytes
            piece = TensorSpec(spec.name, (r1 - r0, spec.shape[1]), spec.dtype, spec.stored_dtype,
                               spec.encoding, spec.role, spec.group, spec.blocksize)
            layouts += layout_group(spec.group, [piece])
    out: dict = {}
    for layout in layouts:
        starts = sorted((off, s) for s, off in ((s, layout.offsets[s.name]) for s in layout.specs))
        for k, (off, s) in enumerate(starts):
            end = starts[k + 1][0] if k + 1 < len(starts) else layout.decoded_size
            t, dec = out.get(s.name, (0, 0))
            out[s.name] = (t + s.nbytes + s.absmax_nbytes, dec + end - off)
    return out


def optimizer_state_bytes(shape: tuple, optimizer: str, state_bytes: int) -> int:
    """Bytes of one tensor's optimizer state, as the implementation allocates it.

    adamw (torch.optim.AdamW): two moments in the dtype of the parameters it updates
    (``state_bytes``) and a float32 ``step``. sgd (torch.optim.SGD, momentum 0): nothing.
    adafactor (transformers' Adafactor, beta1 None): float32 row and column second moments for a
    tensor of 2 or more dimensions, a full float32 second moment for a vector, and a float32 RMS.
    adamw-8bit (bitsandbytes AdamW8bit): two uint8 states and float32 absmax per 256 elements;
    fp32 states for tensors under 4096 elements (the shared quantization maps are counted once,
    by the caller).
    """
    n = math.prod(shape)
    if optimizer == "adamw":
        return 2 * n * state_bytes + 4
    if optimizer == "sgd":
        return 0
    if optimizer == "adafactor":
        if len(shape) >= 2:
            return 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) + 4
        return 4 * n + 4
    if optimizer == "adamw-8bit":
        if n < BNB_MIN_8BIT_SIZE:
            return 8 * n
        return 2 * n + 2 * 4 * (-(-n // BNB_BLOCKSIZE))
    raise PlanError(f"optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)}")


# --------------------------------------------------------------------------------------------
# KV cache and activations


def kv_cache_bytes(dims: Dims, batch: int, seq: int, item: int) -> tuple:
    """``(held, window)``: KV-cache bytes after a forward of ``seq`` tokens.

    ``held`` is 2 x layers x batch x seq x kv_heads x head_dim x bytes: what transformers'
    DynamicCache keeps allocated (a sliding-window layer keeps a view of its last window - 1
    tokens into the full tensor of the step). ``window`` counts sliding layers at
    min(seq, window - 1) tokens: what they hold from the next decoding step on.
    """
    per_token = 2 * batch * dims.kv_heads * dims.head_dim * item
    held = per_token * seq * dims.layers
    window = 0
    for t in dims.layer_types:
        keep = seq
        if t in ("sliding_attention", "chunked_attention") and dims.sliding_window:
            keep = min(seq, dims.sliding_window - 1)
        window += per_token * keep
    return held, window


def _norm_saved(dims: Dims, a: int, width: int, linear_after: bool) -> int:
    """Bytes per token one norm saves for backward, plus the input of the linear that follows
    it, as transformers implements them."""
    if dims.norm == "layer":                     # native layer_norm: input, mean and rstd
        return a * width + 2 * a + (a * width if linear_after else 0)
    if dims.norm == "plus_one":                  # float32 input, rsqrt, normed times (1 + w)
        return 8 * width + 4 + (a * width if linear_after else 0)
    return 4 * width + 4 + a * width + (a * width if linear_after else 0)   # Llama RMSNorm


def train_activations(dims: Dims, batch: int, seq: int, a: int, device: str = "cuda") -> dict:
    """Bytes saved for backward by a training forward with labels (use_cache=False), by term.

    Counted tensor by tensor for the transformers implementations (tests compare the count with
    ``torch.autograd.graph.saved_tensors_hooks`` on real models). ``layers``: every transformer
    layer: its norms, the attention (SDPA keeps q, k, v, its output and a float32 log-sum-exp,
    no seq x seq scores; eager attention keeps the float32 softmax and the scores) and the MLP;
    ``other``: token ids, rotary tables, the final norm, soft-capped logits, the shifted labels;
    ``logprobs``: the float32 log-softmax of the loss (4 x batch x seq x vocab).
    """
    d, t = dims, batch * seq
    h, hd, nh, kv, i = d.hidden, d.head_dim, d.heads, d.kv_heads, d.inter
    labels = 8 + 4 / t                                # shifted labels; the loss's total weight
    if d.conv1d:                                 # GPT-2's block: Conv1D, LayerNorm, dropout
        mask = (a if device == "cpu" else 1) if d.dropout > 0 else 0
        if d.dropout > 0 and device == "cpu":
            # CPU SDPA has no dropout kernel: the math path keeps float32 q, k, v, softmax, mask
            # and dropped-out weights, and a copy of the output for c_proj.
            attn = 12 * h + 3 * 4 * nh * seq + a * h
        else:
            attn = 3 * a * h + 4 * nh + a * h         # q, k, v are views of c_attn's output
        layer = 2 * _norm_saved(d, a, h, True) + attn + 5 * a * i + 2 * mask * h
        per_token = d.layers * layer + mask * h + _norm_saved(d, a, h, True) + 8 + labels
        return {"layers": t * d.layers * layer,
                "other": round(t * (per_token - d.layers * layer)) + 8 * seq,
                "logprobs": 4 * t * d.vocab}
    if d.attn == "eager":
        # repeated k and v, q, the output copy, and per score: float32 softmax, its cast and
        # the soft-capped scores (attn_logit_softcapping)
        cast = a if a != 4 else 0                # softmax(dtype=float32).to(dtype): no copy in fp32
        attn = 4 * a * nh * hd + nh * seq * (4 + cast + (a if d.attn_softcap else 0))
    else:
        attn = a * (2 * nh * hd + 2 * kv * hd) + 4 * nh
        if d.fused_qkv:           # v keeps the fused qkv output alive; o_proj gets a copy
            attn += a * (nh + 2 * kv) * hd - a * kv * hd + a * nh * hd
    if d.qk_norm and d.norm != "plus_one":       # q/k RMSNorms over head_dim (Qwen3)
        attn += nh * (4 * hd + a * hd + 4) + kv * (4 * hd + a * hd + 4)
    if d.qk_norm and d.norm == "plus_one":       # q/k (1 + w) norms in float32 (Gemma-3)
        attn += nh * (8 * hd + 4) + kv * (8 * hd + 4)
    layer = 2 * _norm_saved(d, a, h, True) + attn + 4 * a * i
    norm_consts = 0
    if d.norm == "plus_one":                     # (1 + w) in float32, once per norm
        norms = 2
        if d.block_norms == 4:                   # norms around the MLP too (Gemma-2, 3)
            layer += 2 * _norm_saved(d, a, h, False)
            norms = 4
        norm_consts = d.layers * norms * 4 * h + 4 * h + a
        if d.qk_norm:
            norm_consts += d.layers * 2 * 4 * hd
    softcap = a * d.vocab if d.softcap else 0    # tanh of the soft-capped logits
    other = t * (8 + _norm_saved(d, a, h, True) + softcap + labels)
    rotary = 2 * seq * hd * a                    # cos and sin, shared by every layer
    return {"layers": t * d.layers * layer, "other": round(other) + rotary + norm_consts,
            "logprobs": 4 * t * d.vocab}


def infer_transient(dims: Dims, batch: int, seq: int, a: int) -> int:
    """Peak bytes of the temporaries of one layer in a no-grad forward (an estimate: the MLP's
    three intermediates or the attention's projections, plus the hidden states around them)."""
    d, t = dims, batch * seq
    h, hd = d.hidden, d.head_dim
    norm = 8 * h + 2 * a * h                       # float32 upcast and square, input, output
    attn = a * (2 * h + (2 * d.heads + 3 * d.kv_heads) * hd)
    if d.attn == "eager":
        attn += d.heads * seq * (4 + 2 * a)
    mlp = a * (2 * h + 3 * d.inter)
    return t * max(norm, attn, mlp)


def head_transient(encoding: str, vocab: int, hidden: int, tokens: int, a: int, blocksize: int,
                   device: str) -> int:
    """Temporaries of a quantized LM head (``lct.kernels``' ``NF4Linear``, ``Int8Linear``,
    ``Q8_0Linear``, ``Q6_KLinear``) over ``tokens`` positions, besides its output.

    CUDA: bitsandbytes' ``matmul_4bit`` dequantizes a whole NF4 weight for a multi-token input;
    the other encodings take the chunked path. CPU: the path (fused, tiled or chunked,
    ``kernels/paths.py``) is chosen by timing all three on the first call of each input size,
    so the plan counts the costliest, the chunked one: ``NF4_HEAD_CHUNK_BYTES`` of rows
    dequantized into one scratch buffer beside the rows' slice of the output (the fused and
    tiled kernels hold a copy of the input and a tile a thread). Without the compiled loops
    (``lct.format.native``) an NF4 piece of ``PIECE_ELEMENTS`` also needs the int64 code, the
    float32 scale, the table lookup and the product (20 bytes an element), and the other
    encodings dequantize through a float32 copy of the chunk.
    """
    if device == "cuda" and encoding == C.ENCODING_NF4:
        return vocab * hidden * a
    from lct.format import native
    rows = min(vocab, max(1, C.NF4_HEAD_CHUNK_BYTES // (hidden * a)))
    temporaries = tokens * rows * a
    if not native.available():
        if encoding == C.ENCODING_NF4:
            from lct.format.nf4 import PIECE_ELEMENTS
            piece = min(rows * hidden, max(1, PIECE_ELEMENTS // blocksize) * blocksize)
            temporaries = max(20 * piece, temporaries)
        else:
            temporaries += rows * hidden * 4
    return rows * hidden * a + temporaries


# --------------------------------------------------------------------------------------------
# The plan


@dataclass
class Part:
    """One part of the model and its bytes in a plan.

    ``weights``/``grads``/``optimizer``/``master`` are on the accelerator; ``host`` is what a
    Maximus embedding keeps in host memory instead. ``dense`` is the part's weights at the plan's
    precision (no NF4, no Maximus); ``padding`` is LCT's alignment padding, included in
    ``weights``; ``stored``/``decoded`` come from an artifact's manifest when one was given.
    """

    name: str
    params: int = 0
    tensors: int = 0
    weights: int = 0
    grads: int = 0
    optimizer: int = 0
    master: int = 0
    host: int = 0
    dense: int = 0
    padding: int = 0
    stored: int | None = None
    decoded: int | None = None
    note: str = ""

    @property
    def on_device(self) -> int:
        """Bytes this part keeps on the accelerator."""
        return self.weights + self.grads + self.optimizer + self.master


@dataclass
class Plan:
    """Every figure of a plan: integer counts of parameters or bytes.

    ``total`` is the estimated peak on the accelerator: the largest of ``phases`` (training:
    end of forward, loss backward, LM-head backward, end of backward, optimizer step;
    inference: the layers with the KV cache, then the logits).
    """

    model: str
    model_type: str
    mode: str
    device: str
    batch: int
    seq: int
    vocab_size: int
    base_vocab_size: int
    precision: str
    optimizer: str | None
    kv_dtype: str
    format: str
    maximus: tuple | None
    memory: int | None
    parts: list
    params: int
    trainable_params: int
    weights: int
    grads: int
    optimizer_states: int
    master: int
    activations: int      # train: saved for backward (without the loss's); infer: layer temporaries
    logits: int           # batch x seq x vocab in the activation dtype
    loss: int             # train: float32 log-probs, their gradient and the logits' gradient
    loss_chunked: int     # the same when the loss is computed loss_chunk tokens at a time
    loss_chunk: int
    logits_saving: int    # train: what a chunked loss takes off the peak; infer: what
    #                       logits_to_keep=1 (generate) saves
    kv_cache: int
    kv_cache_window: int
    step_temp: int
    nf4_saving: int
    maximus_saving: int
    host: int
    phases: dict
    total: int
    fits: bool | None
    stored: int | None = None
    decoded: int | None = None
    vocab_delta: dict | None = None       # {mode: peak with the new vocabulary - peak with the old}
    remedies: list = field(default_factory=list)   # [(remedy, bytes it takes off the peak)]
    notes: list = field(default_factory=list)
    head_temp: int = 0    # infer: a quantized head's dequantize-and-matmul temporaries
    final_hidden: int = 0     # infer: the last layer's hidden states, which the head multiplies
    # infer: what each phase holds, {phase: {item: bytes}}, the items named as ``items`` names
    # them (its sum is the phase's figure); train: {}
    phase_items: dict = field(default_factory=dict)
    maximus_priced: tuple | None = None   # the K/N maximus_saving is for: the one applied, or
    #                                       the default of the artifact's shards (or of 32)

    @property
    def peak_phase(self) -> str:
        """The phase at which the accelerator holds the most."""
        return max(self.phases, key=self.phases.get)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["maximus"] = list(self.maximus) if self.maximus else None
        d["maximus_priced"] = list(self.maximus_priced) if self.maximus_priced else None
        d["remedies"] = [list(r) for r in self.remedies]
        d["peak_phase"] = self.peak_phase
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def items(self) -> dict:
        """What the accelerator holds, by item, largest first (``{name: bytes}``)."""
        items = {"weights": self.weights, "gradients": self.grads,
                 "optimizer states": self.optimizer_states, "master weights": self.master,
                 "activations": self.activations, "logits": self.logits, "loss buffers": self.loss,
                 "KV cache": self.kv_cache, "optimizer-step temporaries": self.step_temp,
                 "quantized-head temporaries": self.head_temp,
                 "final hidden states": self.final_hidden}
        return dict(sorted(((k, v) for k, v in items.items() if v), key=lambda kv: -kv[1]))



def plan(model, *, mode: str = "infer", batch: int = 1, seq: int = DEFAULT_SEQ,
         vocab_size: int | None = None, add_tokens: int | None = None,
         precision: str | None = None, optimizer: str = "adamw", kv_dtype: str | None = None,
         format: str | None = None, maximus_resident=None, memory=None,  # noqa: A002
         device: str | None = None, loss_chunk: int = DEFAULT_LOSS_CHUNK,
         blocksize: int | None = None, revision: str | None = None,
         lossy: dict | None = None, options: PlanOptions | None = None,
         **encodings) -> Plan:
    """Plan the memory of MODEL for inference or a training step.

    Args:
        model: a model folder, an LCT artifact, a config.json path, a Hub id, a config dict or a
            transformers config (only config.json is read).
        mode: "infer" (a no-grad forward over batch x seq tokens that fills a KV cache) or
            "train" (forward with labels and use_cache=False, backward, optimizer step).
        batch, seq: batch size and sequence length.
        vocab_size / add_tokens: plan for a resized vocabulary; ``vocab_delta`` then holds what
            the change adds to the peak in each mode.
        precision: bf16, fp16, fp32, or mixed (bf16 weights and gradients, fp32 master weights
            and optimizer states); default: the config's dtype (bf16 if it names none).
        optimizer: adamw, sgd, adafactor or adamw-8bit (train mode).
        kv_dtype: bf16, fp16, fp32 or fp8 (default: the activation dtype).
        format: "hf" (dense weights) or "lct" (LCT's quantized embedding/head, frozen in
            training); default: "lct" for an LCT artifact, whose policy (NF4 and int8 parts,
            blocksize, Maximus shards) is then used and whose stored sizes are reported, else
            "hf".
        maximus_resident: "K/N" or (K, N): the input embedding as a MaximusEmbedding with K of
            N shards on the accelerator and the whole table in host memory.
        memory: the accelerator's memory ("16GiB", "24GB", "512MiB" or bytes) for ``fits``.
        device: "cuda" (foreach optimizers, bitsandbytes' NF4 matmul) or "cpu" (single-tensor
            optimizers, LCT's chunked NF4 head, CPU attention kernels): whose temporaries;
            default: this machine's (``default_device()``).
        loss_chunk: tokens per chunk for the chunked-loss figure.
        lossy, blocksize: the parts ("embed", "head") forced to each lossy encoding,
            ``{encoding: parts}``, and the NF4 block size of ``format="lct"``, as ``lct convert
            --nf4/--int8/.../--blocksize``, for a model that is not an artifact (an artifact's
            are its policy's; giving them is an error); default: both parts in int8
            (``DEFAULT_ENCODING``), what the auto policy picks for the trained models measured
            in docs/BENCHMARKS.md, and 64.
        **encodings: each registered lossy encoding's name as a keyword, its parts
            (``nf4=("embed",), int8=("head",)``), as in ``lossy`` (another keyword is a
            ``TypeError``, as ``PlanOptions`` gives it).
        revision: Hub revision for a Hub id.
        options: all of the above as one ``PlanOptions``, instead of the keywords.

    Returns:
        A ``Plan``; ``total`` is the estimated peak on the accelerator.

    Raises:
        ConfigNotFoundError, PlanError: no config, a model transformers cannot build, or a bad
            option (``option`` names it).

    Example:
        >>> p = plan("google/gemma-2b", mode="train", precision="mixed", memory="80GiB")
        >>> p.params, p.fits
        (2506172416, True)
    """
    asked = PlanOptions(mode=mode, batch=batch, seq=seq, vocab_size=vocab_size,
                        add_tokens=add_tokens, precision=precision, optimizer=optimizer,
                        kv_dtype=kv_dtype, format=format, maximus_resident=maximus_resident,
                        memory=memory, device=device, loss_chunk=loss_chunk,
                        blocksize=blocksize, revision=revision, lossy=lossy, **encodings)
    if options is not None:
        if asked != PlanOptions():
            raise PlanError("give options=PlanOptions(...) or keyword options, not both",
                            option="options")
        asked = options
    cfg, where, artifact = read_config(model, asked.revision)
    given = list(asked.lossy) + (["blocksize"] if asked.blocksize is not None else [])
    if artifact is not None and given:
        raise PlanError(f"{artifact}: an artifact's encodings are its own (lct info shows "
                        f"them), so {given[0]} is not applied to it; plan its source folder "
                        f"with {given[0]} to see another encoding", option=given[0])
    base = model_dims(cfg, where)
    new_vocab = asked.new_vocab(base.vocab)
    manifest = _manifest(artifact) if artifact is not None else None
    options = asked.resolved(base, manifest)
    dims = model_dims(cfg, where, new_vocab) if new_vocab else base
    result = _plan(where, dims, base, manifest, options)
    result.model = where if isinstance(model, dict) else str(model)
    if new_vocab is not None and new_vocab != base.vocab:
        result.vocab_delta = {}
        for m in MODES:
            opts = replace(options, mode=m)
            old = _plan(where, base, base, manifest, opts, remedies=False).total
            new = result.total if m == options.mode else _plan(
                where, dims, base, manifest, opts, remedies=False).total
            result.vocab_delta[m] = new - old
    return result


def _plan(where: str, dims: Dims, base: Dims, manifest, options: PlanOptions, *,
          remedies: bool = True) -> Plan:
    """One plan of ``dims`` (``base``: the config's, before a vocabulary change) with resolved
    ``options``: the parameters by part, what the quantized tables and Maximus change, then the
    peak of each phase (training or inference) against ``options.memory``."""
    o = options
    mode, batch, seq, precision, optimizer, device = \
        o.mode, o.batch, o.seq, o.precision, o.optimizer, o.device
    train = mode == "train"
    a = 4 if precision == "fp32" else 2                  # weight, gradient and activation bytes
    state_bytes = 4 if precision in ("fp32", "mixed") else 2
    encodings, blocksize = _lossy_encodings(manifest, o, o.blocksize)
    shards = (manifest.maximus or {}).get("num_shards") if manifest else None
    mx = o.maximus_resident
    if mx is not None:
        if mx[1] > dims.vocab:
            raise PlanError(f"maximus resident {mx[0]}/{mx[1]}: more shards than the "
                            f"{dims.vocab} rows of the vocabulary", option="maximus_resident")
        shards = shards or mx[1]

    specs = parameter_specs(dims)
    layout = lct_layout(specs, PRECISION_DTYPE[precision], encodings, blocksize,
                        shards) if o.format == "lct" else None
    # {tensor name: its lossy encoding} of the quantized tables in this plan's layout
    quant = {s.name: encodings[s.role] for s in specs if layout is not None and
             s.role in encodings and len(s.shape) == 2}
    quant_specs = set(quant)
    notes: list = []
    parts, trainable, largest = _parts(specs, layout, quant_specs, train, a, optimizer,
                                       state_bytes, precision)
    if dims.tied:
        parts["head"].note = "tied to the embedding"
    if train and quant_specs:
        notes.append("format=lct: the quantized embedding/head are frozen in training (no "
                     "gradients or optimizer states)")
    nf4_saving = _quantized_saving(specs, layout, quant, encodings, blocksize, train, a,
                                   optimizer, state_bytes, precision)
    emb = next(s for s in specs if s.role == "embed")
    row_encoding = quant.get(emb.name)
    priced = mx or ((default_budget(shards), min(shards, dims.vocab)) if shards else
                    (DEFAULT_MAXIMUS[0], min(DEFAULT_MAXIMUS[1], dims.vocab)))
    maximus_saving = _maximus(parts, emb, mx, priced, dims, row_encoding, blocksize, a, batch,
                              seq, notes)
    if manifest is not None:
        _manifest_sizes(manifest, parts)
        if dims.vocab != base.vocab:
            notes.append("the artifact's stored and decoded sizes are for its own vocabulary")

    plist = [p for p in parts.values()
             if p.params or p.name in ("embedding", "layers", "norm", "head")]
    total_of = lambda attr: sum(getattr(p, attr) for p in plist)  # noqa: E731
    weights, grads, opt, master = (total_of(x) for x in ("weights", "grads", "optimizer",
                                                         "master"))
    t = batch * seq
    logits = a * t * dims.vocab
    kv_held, kv_window = kv_cache_bytes(dims, batch, seq, KV_DTYPES[o.kv_dtype])
    chunk = min(o.loss_chunk, t)
    if train:
        f = _train_figures(dims, parts, batch, seq, a, device, weights, master, opt, grads,
                           optimizer, precision, trainable, largest, state_bytes, chunk)
        f.update(kv=0, kv_window=0)
        notes.append(f"training forwards should pass use_cache=False; otherwise they also build "
                     f"a KV cache of {human(kv_held)}")
    else:
        head_rows = {s.name for s in specs if s.role == "head"} | \
            ({emb.name} if dims.tied else set())
        head = next((quant[n] for n in sorted(head_rows) if n in quant), None)
        f = _infer_figures(dims, batch, seq, a, device, blocksize, weights, kv_held, logits,
                           head)
        f.update(kv=kv_held, kv_window=kv_window)
    if dims.attn == "eager":
        notes.append(f"{dims.family} runs eager attention in transformers by default: its "
                     f"seq x seq scores are planned")
    if not dims.measured:
        notes.append(f"{dims.family} has {dims.shape}: its parameters, weights, gradients and "
                     f"optimizer states are exact, its activations and KV cache estimated as "
                     f"for a dense decoder of its sizes")
    if dims.experts:
        e = dims.experts
        active = f", {e['active']} of them per token" if e["active"] else ""
        notes.append(f"experts: {e['count']} per layer{active}; {e['params']:,} of the "
                     f"{sum(s.numel for s in specs):,} parameters "
                     f"({human(e['params'] * a)} of weights) are routed experts"
                     + (f", so a token uses about "
                        f"{_active_params(specs, e):,}" if e["active"] else ""))
    phases = f["phases"]
    total = max(phases.values())
    result = Plan(
        model=where, model_type=dims.family, mode=mode, device=device, batch=batch, seq=seq,
        vocab_size=dims.vocab, base_vocab_size=base.vocab, precision=precision,
        optimizer=optimizer if train else None, kv_dtype=o.kv_dtype, format=o.format, maximus=mx,
        memory=o.memory, parts=plist, params=total_of("params"), trainable_params=trainable,
        weights=weights, grads=grads, optimizer_states=opt, master=master,
        activations=f["activations"], logits=logits, loss=f["loss"],
        loss_chunked=f["loss_chunked"], loss_chunk=chunk, logits_saving=f["logits_saving"],
        kv_cache=f["kv"], kv_cache_window=f["kv_window"], step_temp=f["step"],
        nf4_saving=nf4_saving, maximus_saving=maximus_saving, host=total_of("host"),
        phases=phases, total=total, fits=None if o.memory is None else total <= o.memory,
        head_temp=f.get("head_temp", 0), final_hidden=f.get("final_hidden", 0),
        phase_items=f.get("phase_items", {}), maximus_priced=tuple(priced),
        stored=manifest.stored_bytes if manifest else None,
        decoded=manifest.decoded_bytes if manifest else None, notes=notes)
    if remedies:
        result.remedies = _remedies(result, where, dims, base, manifest, o)
    return result


def _active_params(specs, experts: dict) -> int:
    """Parameters a token runs through in a mixture of experts: all but the routed experts,
    and ``active`` of every ``count`` of those."""
    total = sum(s.numel for s in specs)
    return total - experts["params"] + experts["params"] * experts["active"] // experts["count"]


def _lossy_encodings(manifest, options, blocksize) -> tuple:
    """``({role: lossy encoding}, blocksize)``: as asked (``options.lossy``), else as the
    artifact stores them (its policy's list of parts per encoding), else what the auto policy
    picks for trained models (``DEFAULT_ENCODING``: int8 embedding and head)."""
    from lct.format.encodings import lossy_encodings
    policy = manifest.policy if manifest else {}
    if options.lossy:
        by = {r: e for e, parts in options.lossy.items() for r in parts}
    elif manifest is not None:
        by = {r: e for e in lossy_encodings() for r in policy.get(e) or ()
              if r in C.LOSSY_ROLES}
    else:
        by = {r: DEFAULT_ENCODING for r in C.LOSSY_ROLES}
    return by, blocksize or int(policy.get("blocksize", C.DEFAULT_BLOCKSIZE))


def _parts(specs, layout, quant_specs, train, a, optimizer, state_bytes, precision) -> tuple:
    """``(parts, trainable, largest)``: parameters, weights (the artifact's layout when given)
    and, in training, gradients, optimizer states and master weights of each part."""
    parts = {name: Part(name) for name in PARTS}
    trainable = largest = 0
    any_8bit = False
    for s in specs:
        p = parts[ROLE_PART[s.role]]
        p.params += s.numel
        p.tensors += 1
        p.dense += s.numel * a
        if layout is not None:
            tensor_bytes, span = layout[s.name]
            p.weights += span
            p.padding += span - tensor_bytes
        else:
            p.weights += s.numel * a
        if train and s.name not in quant_specs:
            p.grads += s.numel * a
            p.optimizer += optimizer_state_bytes(s.shape, optimizer, state_bytes)
            p.master += 4 * s.numel if precision == "mixed" else 0
            any_8bit |= optimizer == "adamw-8bit" and s.numel >= BNB_MIN_8BIT_SIZE
            trainable += s.numel
            largest = max(largest, s.numel)
    if any_8bit:
        parts["layers"].optimizer += BNB_QMAP_BYTES
    return parts, trainable, largest


def _quantized_saving(specs, layout, quant, encodings, blocksize, train, a, optimizer,
                      state_bytes, precision) -> int:
    """What the quantized tables save against dense ones, in this mode (frozen when
    training); ``quant``: the laid-out tables' encodings, ``encodings``: by role (the HF-format
    plan's figure of what they would save)."""
    saving = 0
    for s in specs:
        enc = quant.get(s.name) or encodings.get(s.role)
        if len(s.shape) == 2 and enc and get_encoding(enc).fits(tuple(s.shape), blocksize):
            dense = s.numel * a
            if train:
                dense += s.numel * a + optimizer_state_bytes(s.shape, optimizer, state_bytes) + \
                    (4 * s.numel if precision == "mixed" else 0)
            saving += dense - (layout[s.name][1] if layout is not None and s.name in quant
                               else encoded_bytes(enc, s.shape, "float32", blocksize))
    return saving


def _maximus(parts, emb, mx, priced, dims, row_encoding, blocksize, a, batch, seq,
             notes) -> int:
    """Maximus: the input embedding's table in host memory, K of N shards on the accelerator
    (``mx``; or what ``priced``, a default K/N, would save). Moves the embedding's bytes to the
    host in ``parts`` when ``mx`` is given; returns what it saves on the accelerator."""
    rows, width = emb.shape
    k, n = priced
    resident_rows = min(k * -(-rows // n), rows)
    row_bytes = encoded_bytes(row_encoding, (1, width), "float32", blocksize) \
        if row_encoding else width * a
    e, h = parts["embedding"], parts["head"]
    resident = resident_rows * row_bytes
    saving = (0 if dims.tied else e.on_device) - resident
    if mx is not None:
        host = e.weights + e.optimizer + e.master
        if e.grads:     # sparse gradient: values and int64 indices of the rows a batch touches
            host += min(rows, batch * seq) * (width * a + 8)
        if dims.tied:
            h.weights, h.grads, h.optimizer, h.master = e.weights, e.grads, e.optimizer, e.master
            h.note = "tied: the head keeps the whole table on the accelerator"
            notes.append("Maximus on a tied model: the LM head still multiplies by the whole "
                         "table, so the resident shards are an extra copy on the accelerator")
        e.weights, e.grads, e.optimizer, e.master, e.host = resident, 0, 0, 0, host
        e.note = f"Maximus {k}/{n}: {resident_rows} of {rows} rows resident"
    return saving


def _train_figures(dims, parts, batch, seq, a, device, weights, master, opt, grads, optimizer,
                   precision, trainable, largest, state_bytes, chunk) -> dict:
    """A training step's phases (forward, loss backward, head backward, end of backward,
    optimizer step) and what a chunked loss saves."""
    t, V, H = batch * seq, dims.vocab, dims.hidden
    e, h = parts["embedding"], parts["head"]
    acts = train_activations(dims, batch, seq, a, device)
    saved = acts["layers"] + acts["other"]
    fixed = weights + master + opt
    head_grad = h.grads or (e.grads if dims.tied else 0)
    tie_tmp = e.grads if dims.tied else 0     # the embedding's dense gradient, before adding
    step = _step_temp(optimizer, device, precision, trainable, largest, state_bytes)

    def train_phases(tokens_v: int) -> dict:
        # tokens_v: how many positions' logits exist at once (all, or one loss chunk)
        lt = tokens_v * V
        return {
            # logits, their float32 upcast (the loss's), the saved float32 log-probs
            "forward": fixed + saved + a * lt + (4 * lt if a != 4 else 0) + 4 * lt,
            # log-probs, their gradient and the logits' float32 gradient
            "loss backward": fixed + saved + 12 * lt,
            # the logits' gradient, the head's weight gradient, the hidden states' gradient
            "head backward": fixed + saved + a * lt + head_grad + a * t * H,
            "end of backward": fixed + grads + tie_tmp,
            "optimizer step": fixed + (0 if precision == "mixed" else grads) + step,
        }
    phases = train_phases(t)
    return dict(phases=phases, activations=saved, loss=12 * t * V, loss_chunked=12 * chunk * V,
                step=step, logits_saving=max(phases.values()) - max(train_phases(chunk).values()))


def _infer_figures(dims, batch, seq, a, device, blocksize, weights, kv_held, logits,
                   head) -> dict:
    """An inference forward's phases (the layers, then the logits with the temporaries of a
    quantized ``head``) and what keeping only the last position's logits saves."""
    t, V, H = batch * seq, dims.vocab, dims.hidden
    activations = infer_transient(dims, batch, seq, a)
    head_temp = head_transient(head, V, H, t, a, blocksize, device) if is_lossy(head) else 0
    hidden = a * t * H       # the last layer's output, which the head multiplies
    items = {"layers": {"weights": weights, "KV cache": kv_held, "activations": activations},
             "logits": {"weights": weights, "KV cache": kv_held, "final hidden states": hidden,
                        "logits": logits, "quantized-head temporaries": head_temp}}
    items = {phase: {k: v for k, v in held.items() if v} for phase, held in items.items()}
    return dict(phases={phase: sum(held.values()) for phase, held in items.items()},
                phase_items=items, activations=activations, loss=0, loss_chunked=0, step=0,
                logits_saving=logits - a * batch * V, head_temp=head_temp, final_hidden=hidden)


def _remedies(p: Plan, where: str, dims: Dims, base: Dims, manifest,
              options: PlanOptions) -> list:
    """Plan each remedy again (``options`` with one change) and keep those that lower the
    peak."""
    o = options
    tries = []
    if o.format == "hf":
        tries.append(("format=lct (quantized embedding/head)", dict(format="lct")))
    if o.maximus_resident is None and not dims.tied:
        n = min(DEFAULT_MAXIMUS[1], dims.vocab)   # K above N keeps every row, as K = N does
        tries.append((f"maximus_resident={DEFAULT_MAXIMUS[0]}/{DEFAULT_MAXIMUS[1]}",
                      dict(maximus_resident=(min(DEFAULT_MAXIMUS[0], n), n))))
    if o.mode == "train":
        if o.optimizer != "adamw-8bit":
            tries.append(("optimizer=adamw-8bit", dict(optimizer="adamw-8bit")))
        if o.precision in ("fp32", "mixed"):
            tries.append(("precision=bf16", dict(precision="bf16")))
    elif o.kv_dtype != "fp8":
        tries.append(("kv_dtype=fp8", dict(kv_dtype="fp8")))
    if o.batch > 1:
        tries.append((f"batch={o.batch // 2}", dict(batch=o.batch // 2)))
    if o.seq > 1:
        tries.append((f"seq={o.seq // 2}", dict(seq=o.seq // 2)))
    out = []
    for label, change in tries:
        try:
            other = _plan(where, dims, base, manifest, replace(o, **change), remedies=False)
        except PlanError:
            continue
        if other.total < p.total:
            out.append((label, p.total - other.total))
    if o.mode == "train" and p.logits_saving > 0:
        out.append((f"chunked loss ({p.loss_chunk} tokens a chunk)", p.logits_saving))
    return sorted((c for c in out if c[1] > 0), key=lambda c: -c[1])


def _step_temp(optimizer: str, device: str, precision: str, trainable: int, largest: int,
               state_bytes: int) -> int:
    """Temporaries of the optimizer step.

    torch AdamW on CUDA (foreach) takes the square root of every second moment at once (one
    state-sized buffer); on CPU (single-tensor) the root and its scaled copy of the largest
    tensor. transformers' Adafactor works tensor by tensor in float32 (about three float32 copies
    of the largest tensor). SGD and bitsandbytes' fused CUDA kernels work in place; its CPU path
    dequantizes the states of one tensor at a time. Mixed precision
    adds the float32 gradients of the master weights (the half gradients are freed as they are
    converted).
    """
    temp = 0
    if optimizer == "adamw":
        temp = trainable * state_bytes if device == "cuda" else 2 * largest * state_bytes
    elif optimizer == "adafactor":
        temp = 3 * 4 * largest
    elif optimizer == "adamw-8bit" and device == "cpu" and largest >= BNB_MIN_8BIT_SIZE:
        # bitsandbytes' CPU path, tensor by tensor: both states dequantized to float32, the
        # scaled float32 gradient, the root of the second moment and its scaled copy (and a
        # float32 copy of a half-precision parameter)
        temp = (5 + (1 if state_bytes == 2 and precision != "mixed" else 0)) * 4 * largest
    if precision == "mixed":
        temp += 4 * trainable
    return temp


def _manifest(artifact: Path):
    from lct.format.manifest import Manifest
    path = artifact / C.MANIFEST_NAME
    return Manifest.from_json(path.read_bytes(), str(path))


def _manifest_sizes(manifest, parts: dict) -> None:
    """Stored and decoded bytes of an artifact per part: each tensor's span in its decoded chunk
    (to the next tensor) and, for stored bytes, each chunk under the part of its first tensor."""
    for p in parts.values():
        p.stored, p.decoded = 0, 0
    by_chunk: dict = {}
    for t in manifest.tensors.values():
        for pl in t.placements():
            by_chunk.setdefault(pl.chunk, []).append((pl.offset, ROLE_PART.get(t.role)))
    for c in manifest.chunks:
        starts = sorted(by_chunk.get(c.id, []))
        for k, (off, part) in enumerate(starts):
            end = starts[k + 1][0] if k + 1 < len(starts) else c.decoded_size
            if part in parts:
                parts[part].decoded += end - off
        if starts and starts[0][1] in parts:
            parts[starts[0][1]].stored += c.stored_size
