"""`lct export`: an artifact back to a Hugging Face folder."""

from __future__ import annotations

import click

from lct import constants as C

from ._util import GroupProgress


@click.command("export")
@click.argument("artifact", type=click.Path())
@click.argument("out_dir", type=click.Path())
@click.option("--max-shard-size", type=int, default=C.EXPORT_SHARD_SIZE, show_default=True,
              help="Bytes per safetensors shard.")
@click.option("--force", is_flag=True, help="Replace OUT_DIR if it exists.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def export_cmd(artifact, out_dir, max_shard_size, force, quiet):
    """Write ARTIFACT as a Hugging Face folder (safetensors + config + tokenizer) that
    AutoModelForCausalLM.from_pretrained loads. Lossless tensors come out bit-identical to the
    source; NF4 tensors are dequantized exactly as bitsandbytes does."""
    from lct.exporter import export

    bar = GroupProgress("export", unit="group", enabled=not quiet)
    try:
        out = export(artifact, out_dir, max_shard_size=max_shard_size, overwrite=force,
                     progress=bar)
    finally:
        bar.close()
    click.echo(f"wrote {out}")
