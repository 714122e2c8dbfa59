"""`lct export`: an artifact back to a Hugging Face folder."""

from __future__ import annotations

import click

from lct.cli._util import GroupProgress, LossyHelpCommand, quiet_option
from lct.format import constants as C


@click.command("export", cls=LossyHelpCommand, short_help="Write an artifact back as a Hugging Face safetensors folder.")
@click.argument("artifact", type=click.Path())
@click.argument("out_dir", type=click.Path())
@click.option("--max-shard-size", default=C.EXPORT_SHARD_SIZE, show_default=True, metavar="SIZE",
              help="Largest safetensors shard, as save_pretrained takes it: 5GB, 500MB "
                   "(decimal) or 2GiB (binary); default save_pretrained's.")
@click.option("--force", is_flag=True,
              help="Replace OUT_DIR if an earlier lct export wrote it (it carries "
                   ".lct-export.json); any other folder is never replaced.")
@quiet_option("the output folder's path")
def export_cmd(artifact, out_dir, max_shard_size, force, quiet):
    """Write ARTIFACT (a folder, hf://org/name[@rev], pulled first, or s3://, gs:// or
    az://bucket/prefix)
    as a Hugging Face folder (safetensors + config + tokenizer + the other side files) that
    from_pretrained of the model's class loads (AutoModelForCausalLM for a causal LM;
    T5ForConditionalGeneration, LlavaForConditionalGeneration, ... for others: config.json's
    'architectures' names it; `lct info` shows it).

    Lossless tensors come out bit-identical to the source. A lossy table ({lossy}) comes
    out dequantized, as each encoding's rule gives it (docs/FORMAT.md 2.2): the values a load
    computes with, not the source's. A byte-exact round trip of every tensor needs an artifact
    converted with --nf4 none (every table lossless)."""
    from lct.conversion.exporter import export

    bar = GroupProgress("export", unit="group", enabled=not quiet)
    try:
        out = export(artifact, out_dir, max_shard_size=max_shard_size, overwrite=force,
                     progress=bar)
    finally:
        bar.close()
    click.echo(str(out) if quiet else f"wrote {out}")
