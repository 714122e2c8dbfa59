"""`lct verify`: checksums, and optionally every tensor against the source."""

from __future__ import annotations

import sys

import click

from lct.cli._util import (GroupProgress, LossyHelpCommand, LossyHelpOption, quiet_option,
                           table)
from lct.conversion.policy import DEFAULT_BUDGET_KL


@click.command("verify", cls=LossyHelpCommand,
               short_help="Check an artifact's checksums, tensors and quality.")
@click.argument("artifact", type=click.Path())
@click.option("--against", cls=LossyHelpOption, default=None, metavar="SOURCE",
              help="Source folder or Hub id: compare lossless tensors bit for bit, and lossy "
                   "ones ({lossy}) with the source quantized again "
                   "(byte for byte; error and cosine shown beside; a source that holds exactly "
                   "a table's dequantized values, as the artifact's own export does, is that "
                   "table).")
@click.option("--revision", default=None, help="Hub revision of --against.")
@click.option("--quality", is_flag=True,
              help="Also load ARTIFACT and the --against source and compare them on real text: "
                   "perplexity of both, its change, top-1 next-token agreement, KL (nats).")
@click.option("--text", "text", type=click.Path(exists=True), default=None,
              help="Text file or folder for --quality (default: public-domain prose and Python "
                   "source shipped with LCT).")
@click.option("--budget", type=click.FloatRange(min=0, min_open=True), default=None,
              help="--quality: the mean KL (nats) the artifact must stay within; over it, verify "
                   "says OVER and exits 1. Default: the budget it was converted under, else "
                   f"{DEFAULT_BUDGET_KL}.")
@click.option("--max-tokens", type=click.IntRange(1), default=None,
              help="Scored tokens for --quality  [default: 4096].")
@click.option("--layerwise", is_flag=True,
              help="--quality for a model larger than memory: the artifact streams its "
                   "layers on every forward, and the reference is the source run a layer at a "
                   "time from its safetensors files (its tables read in rows, never whole), so "
                   "only the artifact's tables, a layer and a prefetch window are resident.")
@click.option("--dtype", "quality_dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
              default=None,
              help="--quality: what both models compute in. Default: float32, which leaves "
                   "the compute's own rounding out of the KL so that it measures what the "
                   "storage costs (as the conversion's budget is measured), where both models "
                   "fit in half the free memory so, and always with --layerwise; else the "
                   "artifact's dtype. bfloat16 measures what a user running in it sees, "
                   "rounding included.")
@click.option("--expect", default=None, metavar="DIGEST",
              help="The manifest must have this digest (sha256:..., as lct info prints it): a "
                   "pin on every tensor's name, shape, type and place and every chunk's "
                   "checksum. The checksums alone are xxh3_64, which anyone can compute again "
                   "after an edit.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the whole report as JSON (fields in docs/CLI.md) instead of tables.")
@quiet_option("OK or FAILED (the problems on stderr)")
def verify_cmd(artifact, against, revision, quality, text, budget, max_tokens, layerwise,
               quality_dtype, expect, as_json, quiet):
    """Check every chunk of ARTIFACT (a folder, hf://org/name[@rev], pulled first, or
    s3://, gs:// or az://bucket/prefix, read by range requests):
    checksum and decode, every scale of a quantized table finite, every tensor of a type the
    model holds. Exits 1 if anything is wrong, or with --quality if the lossy parts cost
    more than --budget.

    With --against SOURCE, every tensor is compared with the source: lossless ones bit for bit,
    lossy ones ({lossy}) by quantizing the source again. With
    --quality, what the lossy parts cost on text. OK proves the artifact is whole and
    consistent, not that its manifest is the one its writer wrote: pin it with --expect."""
    from lct.conversion.verifier import verify
    from lct.format.encodings import torch_dtype

    if not quality:
        for flag, given in (("--layerwise", layerwise), ("--dtype", quality_dtype),
                            ("--text", text), ("--budget", budget),
                            ("--max-tokens", max_tokens)):
            if given:
                raise click.UsageError(f"{flag} goes with --quality")
    if revision is not None and against is None:
        raise click.UsageError("--revision is the revision of --against SOURCE; give it too")
    if quality and against is None:
        raise click.UsageError("--quality needs --against SOURCE (the lossless reference)")
    from lct.errors import LCTError
    bar = GroupProgress("verify", unit="group", enabled=not quiet)
    qbar = GroupProgress("quality", unit="block", enabled=not quiet)
    try:
        rep = verify(artifact, against=against, revision=revision, progress=bar,
                     quality=quality, text=text, max_tokens=max_tokens, quality_progress=qbar,
                     layerwise=layerwise, expect=expect, budget=budget,
                     quality_dtype=quality_dtype and torch_dtype(quality_dtype))
    except LCTError as e:
        # what stopped the check (a truncated data file, a damaged manifest) is still a
        # verdict for a script reading -q's or --json's stdout; the error line on stderr
        if as_json:
            import json
            click.echo(json.dumps({"ok": False, "error": str(e)}, indent=1))
        elif quiet:
            click.echo("FAILED")
        raise
    finally:
        bar.close()
        qbar.close()
    from lct.format.encodings import is_lossy
    over = rep.quality is not None and not rep.quality.within_budget
    lossy = [t for t in rep.tensors if is_lossy(t.encoding)]
    lossless = [t for t in rep.tensors if not is_lossy(t.encoding)]
    if as_json:
        import json
        from dataclasses import asdict
        click.echo(json.dumps({
            "ok": rep.ok, "chunks_checked": rep.chunks_checked, "failures": rep.failures,
            "lossless_tensors": len(lossless),
            "lossless_identical": sum(t.ok for t in lossless), "cast": rep.cast,
            "lossy_tensors": [asdict(t) for t in lossy],
            "quality": rep.quality.to_dict() if rep.quality is not None else None},
            indent=1))
        if not rep.ok or over:
            sys.exit(1)
        return
    if quiet:
        for f in rep.failures:
            click.echo(f"FAIL {f}", err=True)
        if over:
            click.echo(f"OVER {rep.quality.verdict()}", err=True)
        click.echo("FAILED" if not rep.ok else "OVER" if over else "OK")
        if not rep.ok or over:
            sys.exit(1)
        return
    if lossy:
        click.echo(table([(t.name, t.encoding, "identical" if t.ok else "DIFFER",
                           f"{t.max_err:.3g}", f"{t.mean_err:.3g}", f"{t.cosine:.6f}")
                          for t in lossy],
                         ["lossy tensor", "encoding", "codes vs source re-quantized", "max err",
                          "mean err", "cosine"]))
    if lossless:
        click.echo(f"{sum(t.ok for t in lossless)}/{len(lossless)} lossless tensors bit-identical "
                   f"to the source" + (f" cast to {rep.cast}" if rep.cast else ""))
    if rep.quality is not None:
        q = rep.quality
        click.echo(table([
            ("perplexity, source / artifact", f"{q.ppl_reference:.4f} / {q.ppl:.4f}"),
            ("perplexity change", f"{q.delta_pct:+.2f} %"),
            ("top-1 agreement", f"{q.top1_agreement:.4f}"),
            ("KL mean / max (nats)", f"{q.kl_mean:.5f} / {q.kl_max:.4f}"),
            ("scored", f"{q.tokens} tokens in {q.blocks} blocks")], ["quality", "value"]))
        click.echo(f"quality: {q.verdict()}")
    shown = 20
    for f in rep.failures[:shown]:
        click.echo(f"FAIL {f}", err=True)
    if len(rep.failures) > shown:
        click.echo(f"... and {len(rep.failures) - shown} more", err=True)
    click.echo(f"{rep.chunks_checked} chunks checked: " + ("OK" if rep.ok else
                                                           f"{len(rep.failures)} problem(s)")
               + ("; quality OVER the budget" if over else ""))
    if not rep.ok or over:
        sys.exit(1)
