"""One rank of a tensor-parallel test (tests/test_tensor_parallel.py starts WORLD_SIZE of them):
loads the artifact with ``lct.load(tp_plan="auto")`` and the source with
``from_pretrained(tp_plan="auto")`` and writes what it saw as JSON to ``OUT/rank<r>.json``.
Not a test module (no ``test_`` prefix)."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(art: str, src: str, out: str, nf4: str, corrupt_rank: int, stream: bool) -> None:
    setup = os.environ.get("TP_WORKER_SETUP")   # "module:function", called before the load
    if setup:                                   # (a test's encoding registers itself here)
        import importlib
        module, function = setup.split(":")
        getattr(importlib.import_module(module), function)()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {"rank": rank}
    import lct
    from lct.loader import LoadStats
    from transformers import AutoModelForCausalLM
    path = art
    if rank == corrupt_rank:      # this rank reads a damaged copy; the others the good one
        path = art + ".bad"
    stats = LoadStats()
    try:
        model = lct.load(path, tp_plan="auto", nf4=nf4, stats=stats, dtype=torch.float32,
                         stream=stream)
    except Exception as e:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(e).__name__}: {e}"
        result["failed_rank"] = getattr(e, "failed_rank", None)    # another rank's failure
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()                  # leave together: gloo's threads abort an untidy exit
        dist.destroy_process_group()
        return
    ref = AutoModelForCausalLM.from_pretrained(src, tp_plan="auto", dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 11, 4]])
    with torch.no_grad():
        got, want = model(ids).logits, ref(ids).logits
    mine = {n: p for n, p in model.named_parameters()}
    theirs = {n: p for n, p in ref.named_parameters()}
    common = sorted(set(mine) & set(theirs))   # a kept quantized table has no .weight
    result.update(
        max_diff=float((got - want).abs().max()),
        names_equal=sorted(mine) == sorted(theirs),
        placements=[n for n in common if str(getattr(theirs[n], "placements", None)) !=
                    str(getattr(mine[n], "placements", None))],
        local_shapes=[n for n in common if tuple(getattr(theirs[n], "_local_tensor", theirs[n])
                                                 .shape) != tuple(getattr(
                                                     mine[n], "_local_tensor", mine[n]).shape)],
        bytes_read=stats.bytes_read, bytes_decoded=stats.bytes_decoded, notes=stats.notes,
        cache=stats.cache,
        embed=type(model.get_input_embeddings()).__name__,
        head=type(model.get_output_embeddings()).__name__,
        logits=got[0, :3, :5].tolist())
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]),
         len(sys.argv) > 6 and sys.argv[6] == "stream")
