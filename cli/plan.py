"""`lct plan`: how much memory a model needs for inference or training, from its config.json."""

from __future__ import annotations

import click

from lct.cli._util import EncodingCommand, as_flags, quiet_option, table
from lct.plan.memory import DEFAULT_ENCODING, plan
from lct.plan.options import (
    DEFAULT_LOSS_CHUNK,
    DEFAULT_SEQ,
    DEVICES,
    FORMATS,
    KV_DTYPES,
    MODES,
    OPTIMIZERS,
    PRECISIONS,
    PlanOptions,
)


def _parsed(parser_name: str):
    """A click callback that parses a value with ``lct.plan.options.<parser_name>`` (None stays
    None)."""
    def callback(ctx, param, value):
        if value is None:
            return None
        import lct.plan.options as lp
        try:
            return getattr(lp, parser_name)(value)
        except lp.PlanError as e:
            raise click.BadParameter(str(e)) from None
    return callback


def _encoding_help(e) -> str:
    """The help of ``--ENCODING`` (``EncodingCommand``)."""
    return (f"With --format lct and no artifact: the {e.label} parts, as lct convert "
            f"--{e.name} (none, embed, head or embed,head)."
            + (f" With no encoding option the plan assumes embed,head in {e.label}; lct "
               f"convert's default is the auto policy, which measures the model and may pick "
               f"another encoding (lct info shows it)." if e.name == DEFAULT_ENCODING else ""))


@click.command("plan", cls=EncodingCommand, after="fmt", encoding_help=_encoding_help,
               short_help="Plan the memory a model needs for inference or training.")
@click.argument("model")
@click.option("--mode", type=click.Choice(MODES), default="infer", show_default=True,
              help="infer: a no-grad forward that fills a KV cache; train: forward with labels, "
                   "backward and optimizer step.")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="Sequences run at once (the activations and the KV cache grow with it).")
@click.option("--seq", type=click.IntRange(min=1), default=DEFAULT_SEQ, show_default=True,
              help="Sequence length in tokens.")
@click.option("--vocab-size", type=click.IntRange(min=1), default=None,
              help="Plan for this vocabulary size instead of the config's.")
@click.option("--add-tokens", type=click.IntRange(min=1), default=None,
              help="Plan for the vocabulary grown by N tokens and show what it costs per mode.")
@click.option("--precision", type=click.Choice(PRECISIONS), default=None,
              help="Weights/activations dtype; mixed = bf16 weights and gradients with fp32 "
                   "master weights and optimizer states. Default: the config's dtype.")
@click.option("--optimizer", type=click.Choice(OPTIMIZERS), default="adamw", show_default=True,
              help="Training optimizer (torch AdamW, SGD, transformers Adafactor, "
                   "bitsandbytes AdamW8bit).")
@click.option("--kv-dtype", type=click.Choice(list(KV_DTYPES)), default=None,
              help="KV-cache dtype (default: the activation dtype).")
@click.option("--format", "fmt", type=click.Choice(FORMATS), default=None,
              help="hf: dense weights; lct: LCT's quantized embedding and head (frozen in training). "
                   "Default: lct for an LCT artifact, else hf.")
@click.option("--blocksize", type=click.IntRange(min=2), default=None,
              help="With --format lct and no artifact: the NF4 block size (default 64).")
@click.option("--maximus-resident", callback=_parsed("parse_resident"), metavar="K/N", default=None,
              help="The embedding as Maximus shards, K of N resident on the --device (a GPU's "
                   "memory for cuda), the whole table in host memory.")
@click.option("--memory", callback=_parsed("parse_bytes"), metavar="SIZE", default=None,
              help="Memory of the --device to plan against (a GPU's for cuda, RAM for cpu): "
                   "16GiB, 24GB, 512MiB...")
@click.option("--device", type=click.Choice(DEVICES), default=None,
              help="Whose temporaries to plan: CUDA kernels or the CPU paths. Default: cuda if "
                   "this machine has a CUDA device (torch.cuda.is_available()), else cpu.")
@click.option("--loss-chunk", type=click.IntRange(min=1), default=DEFAULT_LOSS_CHUNK,
              show_default=True,
              help="Tokens per chunk for the chunked-loss figure.")
@click.option("--revision", default=None, help="Hub revision when MODEL is a Hub id.")
@click.option("--json", "as_json", is_flag=True,
              help="Print every figure as JSON (integer parameters and bytes).")
@quiet_option("the peak (and with --memory whether it fits)")
def plan_cmd(model, mode, batch, seq, vocab_size, add_tokens, precision, optimizer, kv_dtype,
             fmt, lossy, blocksize, maximus_resident, memory, device, loss_chunk, revision,
             as_json, quiet):
    """Plan the memory MODEL needs for inference or a training step.

    MODEL is a model folder, an LCT artifact or a Hub id (such as google/gemma-2b); only its
    config.json is read, no weights. The table shows parameters and the bytes of weights,
    gradients, optimizer states and master weights per part; then activations, the logits
    (batch x seq x vocab) and what a chunked loss saves, the KV cache, what LCT's quantized
    embedding/head and Maximus shards save, and the peak against --memory. Parameter counts,
    weight, optimizer and KV-cache bytes are exact; activations and the peak are estimates
    (docs/PLAN.md; benchmarks/bench_plan.py measures them).
    """
    options = PlanOptions(mode=mode, batch=batch, seq=seq, vocab_size=vocab_size,
                          add_tokens=add_tokens, precision=precision, optimizer=optimizer,
                          kv_dtype=kv_dtype, format=fmt, maximus_resident=maximus_resident,
                          memory=memory, device=device, loss_chunk=loss_chunk, lossy=lossy,
                          blocksize=blocksize, revision=revision)
    p = plan(model, options=options)
    if as_json:
        click.echo(p.to_json(), nl=False)
        return
    if quiet:
        from lct.units import human
        click.echo(f"peak {human(p.total)}" + ("" if p.memory is None else
                   f"; {'fits in' if p.fits else 'does not fit in'} {human(p.memory)}"))
        return
    click.echo("\n".join(render(p)))


def render(p) -> list:
    """The human report of a ``Plan``, as lines."""
    from lct.units import human as hb
    train = p.mode == "train"
    what = f"{p.mode}, batch {p.batch} x seq {p.seq}, {p.precision}"
    what += f", {p.optimizer}" if train else f", KV {p.kv_dtype}"
    what += f", format {p.format}, {p.device}"
    if p.maximus:
        what += f", Maximus {p.maximus[0]}/{p.maximus[1]}"
    lines = [f"{p.model} ({p.model_type}): {p.params:,} parameters, vocabulary {p.vocab_size:,}"
             + (f" (was {p.base_vocab_size:,})" if p.vocab_size != p.base_vocab_size else ""),
             what, ""]
    rows = []
    for part in p.parts:
        rows.append([part.name, f"{part.params:,}" if part.params else "-",
                     hb(part.weights) if part.weights or part.params else part.note or "-"]
                    + ([hb(part.grads), hb(part.optimizer), hb(part.master)] if train else [])
                    + ([hb(part.host)] if p.maximus else [])
                    + ([hb(part.stored or 0), hb(part.decoded or 0)] if p.stored is not None
                       else []))
    rows.append(["total", f"{p.params:,}", hb(p.weights)]
                + ([hb(p.grads), hb(p.optimizer_states), hb(p.master)] if train else [])
                + ([hb(p.host)] if p.maximus else [])
                + ([hb(p.stored), hb(p.decoded)] if p.stored is not None else []))
    headers = (["part", "params", "weights"] + (["gradients", "optimizer", "master"] if train
                                                 else [])
               + (["host (Maximus)"] if p.maximus else [])
               + (["stored", "decoded"] if p.stored is not None else []))
    lines.append(table(rows, headers))
    lines.append("")
    dt = "fp32" if p.precision == "fp32" else "bf16/fp16"
    act = [("activations saved for backward" if train else "activations (one layer's "
            "temporaries)", hb(p.activations)),
           (f"logits ({p.batch} x {p.seq} x {p.vocab_size:,}, {dt})", hb(p.logits))]
    if train:
        act.append(("loss buffers (fp32 log-probs, their gradient, the logits' gradient)",
                    hb(p.loss)))
        act.append((f"  chunked loss ({p.loss_chunk} tokens a chunk): buffers "
                    f"{hb(p.loss_chunked)}, peak lower by", hb(p.logits_saving)))
        act.append(("optimizer-step temporaries", hb(p.step_temp)))
    else:
        act.append(("  logits of the last position only (generate) would save",
                    hb(p.logits_saving)))
        act.append((f"final hidden states ({p.batch} x {p.seq} x hidden size, {dt}; at the "
                    f"logits)", hb(p.final_hidden)))
        if p.head_temp:
            act.append(("quantized head's dequantize-and-matmul temporaries (at the logits)",
                        hb(p.head_temp)))
        act.append((f"KV cache ({p.kv_dtype}, {KV_DTYPES[p.kv_dtype]} B an element)",
                    hb(p.kv_cache)))
        if p.kv_cache_window != p.kv_cache:
            act.append(("  with sliding windows, from the next decoding step",
                        hb(p.kv_cache_window)))
    width = max(len(a) for a, _ in act)
    lines += [f"{a.ljust(width)}  {b:>11s}" for a, b in act]
    lines.append("")
    nf4 = f"quantized embedding/head (LCT) {'save' if p.format == 'lct' else 'would save'} " \
        f"{hb(p.nf4_saving)}"
    lines.append(f"{nf4}; {maximus_line(p)}")
    if p.phase_items:      # each phase as the sum of the items listed above
        for i, (phase, held) in enumerate(sorted(p.phase_items.items(),
                                                 key=lambda kv: -p.phases[kv[0]])):
            lead = f"peak: {hb(p.total)} at the {phase}" if i == 0 else \
                f"  at the {phase}: {hb(p.phases[phase])}"
            lines.append(f"{lead} = " + " + ".join(f"{k} {hb(v)}" for k, v in held.items()))
    else:
        phases = ", ".join(f"{k} {hb(v)}" for k, v in p.phases.items())
        lines.append(f"peak: {hb(p.total)} at the {p.peak_phase} ({phases})")
    if p.memory is not None:
        if p.fits:
            lines.append(f"fits in {hb(p.memory)}: {hb(p.memory - p.total)} to spare")
        else:
            lines.append(f"does not fit in {hb(p.memory)}: {hb(p.total - p.memory)} short")
    items = list(p.items().items())[:3]
    lines.append("largest items: " + ", ".join(f"{k} {hb(v)}" for k, v in items))
    if p.remedies and (p.memory is None or not p.fits):
        lines.append("to cut: " + "; ".join(f"{as_flags(k)} (-{hb(v)})"
                                            for k, v in p.remedies[:4]))
    if p.vocab_delta:
        dv = p.vocab_size - p.base_vocab_size
        lines.append(f"vocabulary {dv:+,} tokens: "
                     + ", ".join(f"{m} {'+' if v >= 0 else ''}{hb(v)}"
                                 for m, v in p.vocab_delta.items()))
    if p.stored is not None:
        lines.append(f"artifact: {hb(p.stored)} stored, {hb(p.decoded)} decoded")
    lines += [f"note: {as_flags(n)}" for n in p.notes]
    return lines


def maximus_line(p) -> str:
    """What Maximus K/N does to the planned device's memory (``p.maximus_saving``): the
    embedding's table in host memory and K of its N shards on the device (``p.device``: the GPU,
    or the CPU, whose memory the host's is), which is less there than the whole table, except
    on a tied model, whose head keeps the whole table there anyway."""
    from lct.units import human
    k, n = p.maximus_priced
    now = p.maximus is not None
    dev = "the GPU" if p.device == "cuda" else "the CPU"
    where = (f"{k} of {n} embedding shards on {dev}, the whole table"
             + (f" of {human(p.host)}" if now else "") + " in host memory")
    same = ("; on the CPU host memory is the same memory: --device cuda plans for a GPU"
            if p.device == "cpu" else "")
    if p.maximus_saving >= 0:
        return (f"Maximus {k}/{n} ({where}) {'takes' if now else 'would take'} "
                f"{human(p.maximus_saving)} off {dev}{same}")
    tied = any(x.name == "head" and (x.note or "").startswith("tied") for x in p.parts)
    return (f"Maximus {k}/{n} ({where}) {'adds' if now else 'would add'} "
            f"{human(-p.maximus_saving)} on {dev}"
            + (": the tied head keeps the whole table there, so the resident shards are a "
               "second copy" if tied else "") + same)
