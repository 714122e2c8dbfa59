"""`lct demo`: the main job on a tiny embedded model, no network."""

from __future__ import annotations

import click

from lct.cli._util import quiet_option, table


@click.command("demo", short_help="Run the whole pipeline on a tiny model, offline.")
@click.option("--workdir", type=click.Path(), default=None,
              help="Keep the tiny model, the artifact and the export in this folder to inspect "
                   "them (default: a temporary folder, removed when the demo ends).")
@quiet_option("the folder given to --workdir, else OK (FAILED and exit 1 if a check failed)")
def demo_cmd(workdir, quiet):
    """Build a tiny random Gemma, convert it to LCT, verify it against the source, export it
    back to safetensors and reload it with transformers, then load it with the prefetching
    streaming loader and generate from a prompt; last, score the artifact against the source on
    512 tokens of real text (perplexity, top-1 agreement, KL). Prints the size table, the
    quality line and timings."""
    from lct.demo.run import run_demo
    from lct.units import human

    res = run_demo(workdir, log=(lambda *_: None) if quiet else click.echo)
    if quiet:
        ok = res.verify_ok and res.load_agrees
        click.echo(str(res.workdir) if res.workdir else "OK" if ok else "FAILED")
        if not ok:
            raise SystemExit(1)
        return
    click.echo(table([(g.group, g.tensors, g.encodings, human(g.stored), human(g.decoded))
                      for g in res.groups], ["group", "tensors", "stored as", "stored", "decoded"]))
    click.echo(f"safetensors {human(res.source_bytes)} -> LCT {human(res.artifact_bytes)} "
               f"({res.ratio:.3f}x)")
    if res.policy_line:
        click.echo(res.policy_line)
    click.echo(f"verify: {'OK' if res.verify_ok else 'FAILED'}; lossless tensors bit-identical: "
               f"{res.lossless_identical}; lossy parts min cosine {res.nf4_cosine:.5f}")
    click.echo(f"export reloaded with transformers: logits cosine vs source "
               f"{res.logits_cosine:.5f} (lossy parts: {res.lossy})")
    click.echo(f"lct.load ({res.lossy} kept) vs the exported model: same next token at every "
               f"position: {res.load_agrees}; max |logit difference| {res.load_max_diff:.2g} "
               f"(the kept head sums in float32)")
    q = res.quality
    click.echo(f"quality vs source (lct verify --quality, {q.tokens} tokens of the shipped text): "
               f"perplexity {q.ppl_reference:.2f} -> {q.ppl:.2f} ({q.delta_pct:+.2f} %), top-1 "
               f"agreement {q.top1_agreement:.3f}, mean KL {q.kl_mean:.4f} nats (random weights: "
               f"try it on a real model)")
    click.echo(f"prompt: {res.prompt!r} -> {res.output!r}")
    click.echo(table([(k, f"{v:.2f} s") for k, v in res.timings.items()], ["step", "time"]))
    click.echo(f"files are in {res.workdir}" if res.workdir else
               "the files were in a temporary folder, now removed (--workdir DIR keeps them)")
    if not (res.verify_ok and res.load_agrees):
        raise SystemExit(1)
