"""`lct load`: load an artifact into a ready model, print the time breakdown, optionally generate."""

from __future__ import annotations

import time

import click

from lct.cli._util import quiet_option, table


def _ids(ctx, param, value):
    if value is None:
        return None
    try:
        ids = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter("comma-separated token ids, e.g. 1,5,9") from None
    if not ids:
        raise click.BadParameter("give at least one token id, e.g. 1,5,9")
    return ids


@click.command("load", short_help="Load an artifact into a transformers model and generate.")
@click.argument("artifact", type=click.Path())
@click.option("--prefetch", type=click.IntRange(0, 64), default=2, show_default=True,
              help="Groups decoded ahead of the one being installed (0: strictly sequential).")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda[:N].")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Cast weights at load (default: the stored dtypes).")
@click.option("--nf4", type=click.Choice(["keep", "dequantize"]), default="keep", show_default=True,
              help="Keep the NF4/int8 embedding and head in their encoding, or expand them to "
                   "the model dtype at load.")
@click.option("--workers", type=int, default=None, help="Decode threads (default: all cores).")
@click.option("--no-verify", is_flag=True, help="Skip chunk checksums while streaming.")
@click.option("--expect", default=None, metavar="DIGEST",
              help="Refuse the artifact unless its manifest has this digest (sha256:..., as "
                   "lct info prints it).")
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
                   "requests as they load instead of pulling the files first.")
@click.option("--tp", is_flag=True,
              help="Tensor-parallel over the ranks torchrun started (torchrun --nproc_per_node N "
                   "-m lct load ART --tp): each rank keeps its shards of the model's own plan, "
                   "as from_pretrained(tp_plan='auto'); every rank prints what it read, rank 0 "
                   "the text. The attention and key/value heads must divide by N; an artifact "
                   "converted with --tp-pieces (a multiple of N) lets each rank read only its "
                   "share. Not with --layerwise or --maximus.")
@click.option("--prompt", default=None, help="Generate from this text (needs the artifact's tokenizer).")
@click.option("--ids", default=None, callback=_ids, help="Generate from these token ids (1,5,9).")
@click.option("--max-new-tokens", type=click.IntRange(1, 4096), default=16, show_default=True,
              help="Tokens to generate (greedy) after --prompt or --ids.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the breakdown and the generated text as one JSON object (fields in "
                   "docs/CLI.md).")
@quiet_option("the generated text (nothing without --prompt or --ids)")
def load_cmd(artifact, prefetch, device, dtype, nf4, workers, no_verify, expect, layerwise,
             maximus, stream, tp, prompt, ids, max_new_tokens, as_json, quiet):
    """Load ARTIFACT into a transformers model with the prefetching streaming loader and print a
    breakdown: imports, manifest, read, decode, install, time to ready, time to first token (with
    --prompt or --ids), throughput and peak RSS.

    ARTIFACT is a folder or a Hub address hf://org/name[@revision] (pulled into the Hugging Face
    cache and verified, or with --stream read chunk by chunk over HTTP)."""
    from lct.proc import peak_rss, process_age

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
    if tp:
        if layerwise or maximus is not None:
            raise click.UsageError("--tp does not go with --layerwise or --maximus")
        return _load_tp(artifact, prefetch, device, dtype, nf4, workers, no_verify, stream,
                        prompt, ids, max_new_tokens, as_json, quiet, expect)

    from lct import hub
    source = artifact
    if hub.is_hf_uri(artifact) and stream:
        from lct.hub import remote
        # The local folder of the small files (config, tokenizer); the loader then streams the
        # chunks from the same commit, whatever the branch does meanwhile.
        local, sha, _ = remote.fetch_small(artifact)
        source = f"{hub.HF_SCHEME}{hub.parse_hf_uri(artifact)[0]}@{sha}"
        artifact = str(local)
    elif hub.is_hf_uri(artifact):
        artifact = str(hub.pull(artifact, chunks=no_verify))
    else:
        stream = False

    t0 = time.perf_counter()
    import lct.loader as loader
    from lct.units import human
    tdtype = None
    if layerwise or dtype:
        import torch  # timed: the import cost is part of a cold start
        tdtype = getattr(torch, dtype) if dtype else None
    if layerwise:
        from lct.loader.build import import_model_class
        import_model_class(artifact)
    # Otherwise lct.load imports torch and transformers in a thread beside the decode (the
    # skeleton row).
    imports_s = time.perf_counter() - t0
    stats = loader.LoadStats()
    t1 = time.perf_counter()
    if layerwise:
        model = loader.LayerwiseModel(source if stream else artifact, prefetch=prefetch,
                                      device=device, dtype=tdtype, nf4=nf4, workers=workers,
                                      verify=not no_verify, stream=stream, expect=expect)
    else:
        model = loader.load(source if stream else artifact, prefetch=prefetch, device=device,
                            dtype=tdtype, nf4=nf4, workers=workers, verify=not no_verify,
                            stats=stats, stream=stream, expect=expect,
                            maximus=False if maximus is None else (True if maximus < 0 else maximus))
    ready_s = time.perf_counter() - t1
    age_ready = process_age()
    rows = [("imports" + (" (torch, transformers)" if layerwise else ""), f"{imports_s:.2f} s")]
    if not layerwise:
        rows += [("manifest", f"{stats.manifest_s:.3f} s"),
                 ("skeleton (import torch+transformers, meta model; beside decode)",
                  f"{stats.skeleton_s:.2f} s"),
                 ("read (worker time)", f"{stats.read_s:.2f} s"),
                 ("decode (worker time)", f"{stats.decode_s:.2f} s"),
                 ("waiting for decode", f"{stats.wait_s:.2f} s"),
                 ("install", f"{stats.install_s:.2f} s"),
                 ("bytes read / decoded", f"{human(stats.bytes_read)} / {human(stats.bytes_decoded)}"),
                 ("stream throughput", f"{human(stats.bytes_decoded / max(ready_s, 1e-9))}/s decoded"),
                 ("groups, max in flight", f"{stats.groups}, {stats.max_in_flight}")]
    rows.append(("load to ready", f"{ready_s:.2f} s"))
    report = {"artifact": str(artifact), "imports_s": imports_s, "ready_s": ready_s,
              "process_start_to_ready_s": age_ready, "layerwise": layerwise}
    if not layerwise:
        from dataclasses import asdict
        report["breakdown"] = asdict(stats)
    if age_ready is not None:
        rows.append(("process start to ready", f"{age_ready:.2f} s"))
    try:
        if prompt is not None or ids is not None:
            from lct.loader.generate import generate_timed
            res = generate_timed(model, artifact, prompt=prompt, ids=ids,
                                 max_new_tokens=max_new_tokens)
            age = process_age()
            if age is not None:
                rows.append(("process start to first token",
                             f"{age - (time.perf_counter() - res.first_token_at):.2f} s"))
            report.update(text=res.text, new_tokens=res.new_tokens,
                          tokenize_s=res.tokenize_s, first_token_s=res.first_token_s,
                          tokens_per_s=res.tokens_per_s,
                          process_start_to_first_token_s=None if age is None else
                          age - (time.perf_counter() - res.first_token_at))
            rows += [("tokenizer load + prompt encode", f"{res.tokenize_s:.2f} s"),
                     ("first token (after the tokenizer)", f"{res.first_token_s:.2f} s"),
                     ("generation", f"{res.new_tokens} tokens, {res.tokens_per_s:.1f} tok/s")]
            if quiet and not as_json:
                click.echo(res.text)
            elif not as_json:
                click.echo(f"output: {res.text}")
        if layerwise:
            rows.append(("max resident layers", str(model.max_resident_layers)))
            report["max_resident_layers"] = model.max_resident_layers
        if maximus is not None and not layerwise:
            emb = model.get_input_embeddings()
            rows.append(("maximus", f"{len(emb.resident)}/{emb.num_shards} shards resident, "
                                    f"hit rate {emb.stats.hit_rate:.1%}"))
            report["maximus"] = {"resident_shards": len(emb.resident),
                                 "num_shards": emb.num_shards, "hit_rate": emb.stats.hit_rate,
                                 "lookups": emb.stats.lookups}
    finally:
        if layerwise:
            model.close()
    rows.append(("peak RSS", human(peak_rss())))
    report["peak_rss_bytes"] = peak_rss()
    if quiet and not as_json:
        return
    if as_json:
        import json
        click.echo(json.dumps(report, indent=1))
        return
    click.echo(table(rows, ["step", "value"]))


def _load_tp(artifact, prefetch, device, dtype, nf4, workers, no_verify, stream, prompt, ids,
             max_new_tokens, as_json, quiet, expect=None):
    """``lct load --tp``: one rank of a tensor-parallel load (the process group from torchrun's
    environment); every rank prints its own line, rank 0 the generated text."""
    import os
    import sys

    import torch
    import torch.distributed as dist

    from lct.errors import LCTError

    import lct.loader as loader
    from lct.units import human
    if "RANK" not in os.environ and not dist.is_initialized():
        raise click.UsageError("--tp runs under torchrun: torchrun --nproc_per_node N -m lct "
                               "load ARTIFACT --tp")
    if not dist.is_initialized():
        from lct.loader.build import check_device
        check_device(device)        # before NCCL is asked for: a clear line, not a traceback
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    rank = dist.get_rank()
    if quiet and rank:
        as_json = False
    stats = loader.LoadStats()
    t0 = time.perf_counter()
    try:
        model = loader.load(artifact, prefetch=prefetch, device=device, nf4=nf4,
                            workers=workers, verify=not no_verify, stats=stats, stream=stream,
                            tp_plan="auto", dtype=getattr(torch, dtype) if dtype else None,
                            expect=expect)
    except LCTError as e:
        # Every rank has the same error (the load agrees on it): the group is left together,
        # the one line printed, and the process ends at once. A normal interpreter exit after
        # a failed distributed load sometimes aborts in gloo's threads (measured: 2 of 6 runs,
        # "terminate called without an active exception", status -6).
        _shut_down(dist)
        from lct.cli._util import error_line
        click.echo(error_line(e), err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    ready_s = time.perf_counter() - t0
    from lct.proc import peak_rss, process_age
    report = {"rank": rank, "world_size": dist.get_world_size(), "ready_s": ready_s,
              "process_start_to_ready_s": process_age(), "bytes_read": stats.bytes_read,
              "bytes_decoded": stats.bytes_decoded, "peak_rss_bytes": peak_rss(),
              "notes": stats.notes}
    if prompt is not None or ids is not None:
        from lct.loader.generate import generate_timed
        res = generate_timed(model, artifact, prompt=prompt, ids=ids,
                             max_new_tokens=max_new_tokens)
        age = process_age()
        report.update(text=res.text, new_tokens=res.new_tokens,
                      first_token_s=res.first_token_s,
                      process_start_to_first_token_s=None if age is None else
                      age - (time.perf_counter() - res.first_token_at))
    for turn in range(dist.get_world_size()):   # one rank at a time: lines never interleave
        if turn == rank:
            if as_json:
                import json
                click.echo(json.dumps(report))
            elif quiet:
                if rank == 0 and "text" in report:
                    click.echo(report["text"])
            else:
                click.echo(f"rank {rank}/{report['world_size']}: read "
                           f"{human(stats.bytes_read)}, decoded {human(stats.bytes_decoded)}, "
                           f"ready in {ready_s:.2f} s")
                if rank == 0:
                    for note in stats.notes:
                        click.echo(f"note: {note}")
                    if "text" in report:
                        click.echo(f"output: {report['text']}")
            sys.stdout.flush()
        dist.barrier()
    _shut_down(dist)


def _shut_down(dist) -> None:
    """Leave the process group together: a barrier, then its destruction."""
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
