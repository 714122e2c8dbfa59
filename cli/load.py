"""`lct load`: load an artifact into a ready model, print the time breakdown, optionally generate."""

from __future__ import annotations

import time

import click

from lct.cli._util import LossyHelpOption, quiet_option, table
from lct.io.stream import DEFAULT_PREFETCH


def _ids(ctx, param, value):
    if value is None:
        return None
    parts = [x.strip() for x in value.split(",")]
    if not any(parts):
        raise click.BadParameter("give at least one token id, e.g. 1,5,9")
    try:
        return [int(x) for x in parts]
    except ValueError:
        bad = next(x for x in parts if not x.lstrip("-").isdigit())
        raise click.BadParameter(f"comma-separated token ids, e.g. 1,5,9; got "
                                 f"{bad or 'an empty one'!r} in {value!r}") from None


class _Ranks(click.ParamType):
    """``--tp``'s value: a number of ranks, at least 1 (0: ``--tp`` alone, under torchrun)."""

    name = "N"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            n = int(value)
        except ValueError:
            self.fail(f"{value!r} is not a number of ranks: --tp N starts N ranks, --tp alone "
                      f"is one rank of a job torchrun started (give ARTIFACT before --tp)",
                      param, ctx)
        if n < 1:
            self.fail(f"{n}: a job has at least 1 rank", param, ctx)
        return n


@click.command("load", short_help="Load an artifact into a transformers model and generate.")
@click.argument("artifact", type=click.Path())
@click.option("--prefetch", type=int, default=DEFAULT_PREFETCH, show_default=True,
              help="Groups decoded ahead of the one being installed (0: strictly sequential; "
                   "checked by the load, as lct.load checks it).")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda[:N].")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Cast weights at load (default: the stored dtypes).")
@click.option("--nf4", cls=LossyHelpOption, type=click.Choice(["keep", "dequantize"]),
              default="keep", show_default=True,
              help="Keep a lossy embedding and head ({lossy}) in their encoding, or expand them "
                   "to the model dtype at load.")
@click.option("--workers", type=int, default=None, help="Decode threads (default: all cores).")
@click.option("--no-verify", is_flag=True, help="Skip chunk checksums while streaming.")
@click.option("--expect", default=None, metavar="DIGEST",
              help="Refuse the artifact unless its manifest has this digest (sha256:..., as "
                   "lct info prints it).")
@click.option("--cache/--no-cache", "cache", default=None,
              help="Use the local decoded cache (lct cache --help): map what an earlier load "
                   "(or lct cache fill) of this artifact decoded, or keep this load's decode "
                   "there for the next start (the command ends once it is written; with "
                   "--layerwise or --tp, a background fill decodes the artifact once more for "
                   "it). Default: LCT_CACHE (1/0), else on.")
@click.option("--page-cache", type=click.Choice(["auto", "keep", "drop"]), default=None,
              help="What happens to the page-cache pages of the artifact's compressed bytes once "
                   "decoded: auto drops those this load read from disk when --cache keeps its "
                   "decode (the next load maps that) and keeps them otherwise; keep keeps all; "
                   "drop drops all (a cold load without the cache is faster, the next one "
                   "reads the disk again). Default: auto (keep with --layerwise, which reads "
                   "the layers again on every forward).")
@click.option("--layerwise", is_flag=True,
              help="Keep only embedding, head and the prefetch window of layers resident "
                   "(for models larger than memory); layers stream on every forward. For "
                   "models with one stack of layers (decoder-only; not T5, Whisper or a "
                   "vision-language model).")
@click.option("--maximus", "maximus", type=int, is_flag=False, flag_value=-1, default=None,
              help="Install a MaximusEmbedding from the artifact's shard state (optional value: "
                   "the resident budget in shards, at least 1; alone: the budget the artifact "
                   "stores, by default a quarter of the shards).")
@click.option("--stream", is_flag=True,
              help="For an hf://org/name[@revision] ARTIFACT: fetch the chunks by HTTP range "
                   "requests as they load instead of pulling the files first (an s3://, gs:// "
                   "or az:// one always streams; a local folder is read as it is).")
@click.option("--tp", type=_Ranks(), is_flag=False, flag_value=0, default=None,
              help="Tensor-parallel: --tp N starts N ranks on this machine (gloo on CPU, NCCL "
                   "with --device cuda); --tp alone is one rank of a job torchrun started "
                   "(torchrun --nproc_per_node N -m lct load ART --tp). Each rank keeps its "
                   "shards of the model's own plan, as from_pretrained(tp_plan='auto'); every "
                   "rank prints what it read, rank 0 the text. A rank that fails prints one "
                   "line, 'error: rank R: ...', without a traceback (an error that is not "
                   "LCT's, a bug, shows its traceback first; LCT_DEBUG=1 shows every error's); "
                   "under torchrun, torchrun adds its own report. The attention and key/value heads must divide by N; an "
                   "artifact converted with --tp-pieces (a multiple of N) lets each rank read "
                   "only its share. Not with --layerwise or --maximus.")
@click.option("--prompt", default=None, help="Generate from this text (needs the artifact's tokenizer).")
@click.option("--ids", default=None, callback=_ids, help="Generate from these token ids (1,5,9).")
@click.option("--max-new-tokens", type=click.IntRange(1, 4096), default=16, show_default=True,
              help="Tokens to generate (greedy) after --prompt or --ids.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the breakdown and the generated text as one JSON object (fields in "
                   "docs/CLI.md).")
@quiet_option("the generated text (nothing without --prompt or --ids)")
def load_cmd(artifact, prefetch, device, dtype, nf4, workers, no_verify, expect, cache, page_cache,
             layerwise, maximus, stream, tp, prompt, ids, max_new_tokens, as_json, quiet):
    """Load ARTIFACT into a transformers model with the prefetching streaming loader and print a
    breakdown: imports, manifest, read, decode, install, time to ready, time to first token (with
    --prompt or --ids), throughput and peak RSS.

    ARTIFACT is a folder, a Hub address hf://org/name[@revision] (pulled into the Hugging Face
    cache and verified, or with --stream read chunk by chunk over HTTP), or an object store's
    s3://bucket/prefix, gs://bucket/prefix or az://container/prefix (always read chunk by chunk;
    credentials as each cloud's own tools take them, docs/PUBLISHING.md)."""
    if prompt is not None and ids is not None:
        raise click.UsageError("give --prompt or --ids, not both")
    if prompt is not None:
        from lct.loader.generate import check_prompt_source
        check_prompt_source(artifact)
    if maximus is not None and maximus != -1 and maximus < 1:
        raise click.UsageError(f"--maximus {maximus}: the budget is a number of resident shards, "
                               f"at least 1 (or --maximus alone for the stored policy's)")
    if layerwise and maximus is not None:
        raise click.UsageError("--maximus does not go with --layerwise (the layer-wise model "
                               "keeps the embedding as stored)")
    options = dict(prefetch=prefetch, device=device, dtype=dtype, nf4=nf4, workers=workers,
                   verify=not no_verify, expect=expect, cache=cache)
    if page_cache is not None:
        options["page_cache"] = page_cache
    generate = dict(prompt=prompt, ids=ids, max_new_tokens=max_new_tokens)
    if tp is not None:
        if layerwise or maximus is not None:
            raise click.UsageError("--tp does not go with --layerwise or --maximus")
        import os
        if tp and "RANK" not in os.environ:
            return _launch_tp(tp)
        if tp and os.environ.get("WORLD_SIZE") != str(tp):
            raise click.UsageError(f"--tp {tp} in a job of {os.environ.get('WORLD_SIZE')} "
                                   f"ranks: under torchrun, give --tp alone")
        return _load_tp(artifact, options, stream, generate, as_json, quiet)

    from lct.loader.source import resolve
    where = resolve(artifact, stream=stream, verify=not no_verify)
    t0 = time.perf_counter()
    import lct.loader as loader
    if layerwise:
        # Timed: the imports are part of a cold start (lct.load does them in a thread beside
        # the decode: the skeleton row).
        from lct.loader.build import import_model_class
        import_model_class(where.folder)
    imports_s = time.perf_counter() - t0
    stats = None if layerwise else loader.LoadStats()
    t1 = time.perf_counter()
    if layerwise:
        model = loader.LayerwiseModel(where.source, stream=where.stream, **options)
    else:
        model = loader.load(where.source, stream=where.stream, stats=stats, **options,
                            maximus=False if maximus is None
                            else (maximus if maximus > 0 else True))
    from lct.loader.report import LoadReport
    report = LoadReport(where.folder, imports_s, time.perf_counter() - t1, stats,
                        layerwise=layerwise)
    try:
        if prompt is not None or ids is not None:
            from lct.loader.generate import generate_timed
            res = generate_timed(model, where.folder, **generate)
            report.generation(res)
            if not as_json:
                click.echo(res.text if quiet else f"output: {res.text}")
        if layerwise:
            report.layerwise(model)
        elif maximus is not None:
            report.maximus(model.get_input_embeddings())
    finally:
        if layerwise:
            model.close()
    report.finish()
    if as_json:
        import json
        click.echo(json.dumps(report.data, indent=1))
    elif not quiet:
        click.echo(table(report.rows, ["step", "value"]))
    if stats is not None and stats.cache == "filling":
        from lct.io.cache import wait_fills
        if not quiet:
            click.echo("keeping the decoded copy for the next start (lct cache list shows it; "
                       "--no-cache or LCT_CACHE=0 skips it) ...", err=True)
        for f in wait_fills():     # the process ends with os._exit: no atexit to wait for it
            if not f.done and f.reason and not quiet:
                click.echo(f"note: the decoded cache was not filled: {f.reason}", err=True)


def _launch_tp(world: int):
    """``lct load --tp N`` outside a job: this command line again as ``world`` ranks on this
    machine (``lct.loader.tensor_parallel.launch``). The ranks print their own lines, errors
    included; a rank ended by a signal, which printed nothing, is said here. Exit status: 0
    when every rank succeeded, else a failed rank's (1 where a signal ended it)."""
    import signal
    import sys

    from lct.cli._util import ARGV
    from lct.loader.tensor_parallel import launch
    ctx = click.get_current_context()
    args = ctx.meta.get(ARGV)
    if args is None:
        raise click.UsageError("--tp N starts the lct command again in N processes: run it as "
                               "lct, not through another program")
    exits = launch(world, [sys.executable, "-m", "lct", *args])
    for x in exits:
        if x.code < 0 and not x.stopped:
            try:
                how = signal.Signals(-x.code).name
            except ValueError:
                how = f"signal {-x.code}"
            click.echo(f"error: rank {x.rank}: ended by {how}, before it could say why",
                       err=True)
    failed = [x.code for x in exits if x.code]
    if failed:
        ctx.exit(next((c for c in failed if c > 0), 1))


def _load_tp(artifact, options: dict, stream: bool, generate: dict, as_json: bool, quiet: bool):
    """``lct load --tp``: one rank of a tensor-parallel load in the process group torchrun's
    (or ``--tp N``'s) environment describes; every rank prints its own line, rank 0 the
    generated text. A rank whose load failed prints ``error: rank R: ...``; a rank that only
    heard of another's failure prints nothing, so each failure is said once. An error that is
    not LCT's (a bug) prints its traceback first; LCT_DEBUG=1 prints every error's. torch's
    DTensor UserWarnings are not shown (``dtensor_warnings_ignored``)."""
    import os
    import sys
    import traceback

    import lct.loader as loader
    from lct.cli._util import error_line
    from lct.errors import LCTError
    from lct.loader.report import rank_report
    from lct.loader.tensor_parallel import dtensor_warnings_ignored, in_turn, rank_group
    from lct.units import human
    stats = loader.LoadStats()
    me = os.environ.get("RANK")       # None: not in a job, which rank_group refuses
    try:
        with rank_group(options["device"]) as (rank, world), dtensor_warnings_ignored():
            t0 = time.perf_counter()
            model = loader.load(artifact, stream=stream, stats=stats, tp_plan="auto", **options)
            ready_s = time.perf_counter() - t0
            res = None
            if generate["prompt"] is not None or generate["ids"] is not None:
                from lct.loader.generate import generate_timed
                res = generate_timed(model, artifact, **generate)
            report = rank_report(rank, world, ready_s, stats, res)

            def say():
                if as_json and not (quiet and rank):
                    import json
                    click.echo(json.dumps(report))
                elif quiet:
                    if rank == 0 and res is not None:
                        click.echo(res.text)
                else:
                    click.echo(f"rank {rank}/{world}: read {human(stats.bytes_read)}, decoded "
                               f"{human(stats.bytes_decoded)}, ready in {ready_s:.2f} s")
                    if rank == 0:
                        for note in stats.notes:
                            click.echo(f"note: {note}")
                        if res is not None:
                            click.echo(f"output: {res.text}")
                sys.stdout.flush()
            in_turn(say)
    except Exception as e:  # noqa: BLE001 - every failure ends the rank with its line
        # Every rank has an error (the ranks agree on it) and has left the group: the line is
        # printed and the process ends at once, since a normal interpreter exit after a failed
        # distributed load sometimes aborts in gloo's threads (measured: 2 of 6 runs,
        # "terminate called without an active exception", status -6).
        failed = getattr(e, "failed_rank", None)
        if failed is None or str(failed) == me:          # this rank's own failure
            lct_error = isinstance(e, LCTError)
            if not lct_error or os.environ.get("LCT_DEBUG"):
                traceback.print_exc()
            line = error_line(e, click.get_current_context().command) if lct_error else \
                f"error: {type(e).__name__}: {e} (a bug in LCT: the traceback above)"
            if me is not None:
                line = f"error: rank {me}: {line.removeprefix('error: ')}"
            click.echo(line, err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
