"""`lct convert`: a Hugging Face checkpoint to an LCT artifact."""

from __future__ import annotations

from pathlib import Path

import click

from lct.cli._util import EncodingCommand, GroupProgress, quiet_option
from lct.conversion.policy import CALIBRATION_NONE, DEFAULT_BUDGET_KL, ESTIMATE_MARGIN
from lct.format import constants as C


def _parse_calibration(ctx, param, value):
    """``--calibration``: None, ``none`` (the proxy), or a text file or folder that exists."""
    if value is None or value == CALIBRATION_NONE:
        return value
    if not Path(value).exists():
        raise click.BadParameter(f"{value}: no such text file or folder (or: none)")
    return value


def _encoding_help(e) -> str:
    """The help of ``--ENCODING`` (``EncodingCommand``)."""
    return f"Force these parts to {e.summary or e.label}: embed, head, embed,head or none."


@click.command("convert", cls=EncodingCommand, after="revision", encoding_help=_encoding_help,
               short_help="Convert a Hugging Face checkpoint (folder or Hub id) to an LCT artifact.")
@click.argument("source")
@click.option("-o", "--output", "output", required=True, type=click.Path(),
              help="Artifact directory to create (appears atomically when complete).")
@click.option("--revision", default=None, help="Hub revision (branch, tag or commit) of SOURCE.")
@click.option("--budget", type=float, default=DEFAULT_BUDGET_KL, show_default=True,
              help="Automatic choice: the most the lossy parts may cost, as mean KL of the "
                   "next-token distribution in nats (0.01 is about +1 % perplexity). A float32 "
                   f"calibration estimate is multiplied by {ESTIMATE_MARGIN:g}, its measured "
                   "error, before it is held to it.")
@click.option("--calibration", default=None, callback=_parse_calibration, metavar="TEXT|none",
              help="What the automatic choice measures each candidate on. Default: the text "
                   "shipped with LCT (256 tokens of prose and code) run through the source "
                   "model (in float32 where that fits in half the free memory, else in its "
                   "own dtype) when it has a tokenizer and fits there, else the text-free "
                   "proxy. TEXT: your text file or folder instead (up to 2048 "
                   "tokens). none: the text-free proxy (fastest, least exact).")
@click.option("--dtype", type=click.Choice(C.CAST_TARGETS), default=None,
              help="Cast the lossless floating-point tensors (refused if a value overflows). "
                   "Default: keep each tensor's source dtype.")
@click.option("--level", type=click.IntRange(*C.ZSTD_LEVELS), default=C.DEFAULT_LEVEL, show_default=True,
              help="zstd level for the lossless planes: 1-22, higher is smaller and slower; "
                   "negative is faster; 0 is zstd's default (3). See docs/BENCHMARKS.md.")
@click.option("--blocksize", type=int, default=C.DEFAULT_BLOCKSIZE, show_default=True,
              help="NF4 block size; must divide the hidden size (the automatic choice "
                   "leaves NF4 out where it does not, and says so).")
@click.option("--codec", type=click.Choice([C.CODEC_PLANES, C.CODEC_ZSTD, C.CODEC_RAW]),
              default=C.CODEC_PLANES, show_default=True,
              help="Codec for lossless chunks: planes (exponent/mantissa split), zstd, raw.")
@click.option("--max-file-size", default="4GiB", show_default=True, metavar="SIZE",
              help="Start a new data file past this size: 4GiB, 2GB, 500MB...")
@click.option("--workers", type=int, default=None, help="Compression threads (default: all cores).")
@click.option("--maximus-shards", type=click.IntRange(min=1), is_flag=False,
              flag_value=C.DEFAULT_MAXIMUS_SHARDS, default=None,
              help=f"Store the embedding (and an untied head) as N frequency-ordered shards with "
                   f"Maximus shard state (--maximus-shards without N: "
                   f"{C.DEFAULT_MAXIMUS_SHARDS}).")
@click.option("--tp-pieces", type=click.IntRange(2, C.MAX_TP_PIECES), default=None, metavar="N",
              help="Store every weight the model's tensor-parallel plan splits as N pieces "
                   "along the split dimension, each its own chunk, so that a rank of any degree "
                   "dividing N reads only its share (lct load --tp).")
@click.option("--token-freq", type=click.Path(exists=True), default=None,
              help="Token frequencies for --maximus-shards: a text file or folder (tokenized "
                   "with the model's tokenizer), or counts (.json list/object, .npy array).")
@click.option("--force", is_flag=True,
              help="Replace OUTPUT if it is an existing LCT artifact made only of its own files; "
                   "any other folder is never replaced (an empty one is filled).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the result as one JSON object (fields in docs/CLI.md); bars stay on "
                   "stderr.")
@quiet_option("the artifact's path")
def convert_cmd(source, output, revision, lossy, budget, calibration, dtype, level, blocksize,
                codec, max_file_size, workers, maximus_shards, tp_pieces, token_freq, force,
                quiet, as_json):
    """Convert SOURCE (a local model folder with safetensors, or a Hub id such as
    google/gemma-2b or hf://google/gemma-2b@main) into an LCT artifact.

    Each transformer layer becomes an independent compressed chunk, kept losslessly in its dtype.
    The embedding and the LM head (a tied table once) are stored in the smallest encoding that
    keeps the model faithful: one of the lossy encodings (each has its option below: NF4, int8
    with one scale per row or per 128 values, Q8_0, Q6_K ...) or lossless, chosen by running the
    source model on a calibration text (LCT's own by default, or --calibration TEXT; the
    text-free proxy where the model cannot run) against --budget. An encoding's option forces
    the choice instead (--nf4 embed,head; --q8_0 head ...); the parts no option names are then
    lossless, and a tied embedding/head is one table: name both or neither. Pickle checkpoints
    (.bin) are refused. HF_HUB_OFFLINE=1 uses only the local Hugging Face cache.
    """
    from lct.conversion.converter import Policy, convert
    from lct.units import parse_size
    max_file_size = parse_size(max_file_size, "--max-file-size")
    if token_freq and not maximus_shards:
        raise click.UsageError("--token-freq needs --maximus-shards")
    policy = Policy(lossy=lossy, budget=budget, calibration=calibration, blocksize=blocksize,
                    dtype=dtype, codec=codec, level=level, maximus_shards=maximus_shards,
                    tp_pieces=tp_pieces)
    bar = GroupProgress("convert", enabled=not quiet)
    # The policy's measurement: tokens run through the source model, what runs beside them
    # (which candidate on which part); closed as the next stage starts.
    measure = GroupProgress("measure", unit="tok", enabled=not quiet, count=False)

    def stage(text):
        measure.close()
        bar.stage(text)
    try:
        rep = convert(source, output, revision=revision, policy=policy,
                      max_file_size=max_file_size, workers=workers, overwrite=force, progress=bar,
                      token_freq=token_freq, stage=stage, measuring=measure)
    finally:
        measure.close()
        bar.close()
    m = rep.manifest
    from lct.io.info import data_bytes, size_ratio, source_weight_bytes
    from lct.units import human
    ratio = size_ratio(m)
    if as_json:
        import json
        click.echo(json.dumps({
            "path": str(rep.path), "seconds": rep.seconds, "mb_per_s": rep.mb_per_s,
            "source_bytes": source_weight_bytes(m), "stored_bytes": m.stored_bytes,
            "data_bytes": data_bytes(m), "ratio": ratio, "groups": len(m.groups),
            "tensors": len(m.tensors), "policy": m.policy, "ties": m.ties,
            "skipped_files": [{"name": n, "why": w} for n, w in rep.skipped_files],
            "unmapped": rep.unmapped}, indent=1))
        return
    if quiet:
        click.echo(str(rep.path))
        return
    from lct.io.info import architecture_line
    split = ""
    if rep.decision is not None and rep.decision.method != "none":   # where the time went
        measured, encoded = rep.decision.seconds, rep.encode_seconds
        split = (f": read in {max(0.0, rep.seconds - measured - encoded):.1f} s, measured in "
                 f"{measured:.1f} s, encoded in {encoded:.1f} s")
    click.echo(f"wrote {rep.path}: {len(m.groups)} groups, {len(m.tensors)} tensors, "
               f"{human(data_bytes(m))} from {human(source_weight_bytes(m) or 0)} of safetensors "
               f"({ratio or 0:.3f}x) in {rep.seconds:.1f} s{split} "
               f"({human(rep.mb_per_s * 1e6)}/s)")
    click.echo(architecture_line(m))
    if rep.decision is not None:
        click.echo(rep.decision.summary())
    else:
        click.echo("policy manual: every tensor lossless")
    if m.maximus:
        fs = m.maximus["frequency_source"]
        click.echo(f"maximus: {m.maximus['num_shards']} shards of {', '.join(m.maximus['tensors'])}"
                   + (f", ordered by {fs['tokens']:,} counted tokens ({fs['kind']})"
                      if fs["kind"] != "none" else
                      "; no --token-freq given, so the shards are in token-id order"))
    if m.ties:
        click.echo("tied: " + ", ".join(f"{k} -> {v}" for k, v in m.ties.items()))
    if rep.skipped_files:
        click.echo("note: not carried from the source: " + "; ".join(
            f"{name} ({why})" for name, why in rep.skipped_files[:5])
            + (" ..." if len(rep.skipped_files) > 5 else ""), err=True)
    if rep.unmapped:
        click.echo(f"note: {len(rep.unmapped)} stored tensor(s) that "
                   f"{m.architecture.get('class')} ignores (as from_pretrained does) were kept "
                   f"in group 'misc': {', '.join(rep.unmapped[:5])}"
                   + (" ..." if len(rep.unmapped) > 5 else ""), err=True)
