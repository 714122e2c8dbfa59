"""What ``lct load`` reports of one load, built in one place: the rows of its table and the
JSON object docs/CLI.md lists, from the load's ``LoadStats``, the timed generation's
``GenerationResult`` and the process's own clock and peak memory."""

from __future__ import annotations

from dataclasses import asdict


class LoadReport:
    """The report of one load in a process (``rows`` for the table, ``data`` for ``--json``).

    Example:
        >>> report = LoadReport("m.lct", imports_s, ready_s, stats)
        >>> report.generation(generate_timed(model, "m.lct", ids=[1, 5, 9]))
        >>> report.finish()
    """

    def __init__(self, artifact: str, imports_s: float, ready_s: float, stats=None, *,
                 layerwise: bool = False):
        from lct.proc import process_age
        from lct.units import human
        self.rows: list = [("imports" + (" (torch, transformers)" if layerwise else ""),
                            f"{imports_s:.2f} s")]
        if stats is not None:
            # a hit maps the decoded copy: its bytes were neither read from the artifact nor
            # decoded, and its mapping and checks are the "read" workers' time
            mapped = (stats.cache or "").startswith("hit: mapped")
            self.rows += [
                ("manifest", f"{stats.manifest_s:.3f} s"),
                ("skeleton (import torch+transformers, meta model; beside decode)",
                 f"{stats.skeleton_s:.2f} s"),
                ("read (worker time)", f"{stats.read_s:.2f} s"),
                ("decode (worker time)", f"{stats.decode_s:.2f} s"),
                ("waiting for decode", f"{stats.wait_s:.2f} s"),
                ("install", f"{stats.install_s:.2f} s"),
                ("bytes read / decoded",
                 f"{human(stats.bytes_read)} / {human(stats.bytes_decoded)}"),
                ("stream throughput",
                 f"{human(stats.bytes_decoded / max(ready_s, 1e-9))}/s "
                 f"{'mapped from the decoded cache' if mapped else 'decoded'}"),
                ("groups, max in flight", f"{stats.groups}, {stats.max_in_flight}"),
                ("decoded cache", stats.cache)]
        self.rows.append(("load to ready", f"{ready_s:.2f} s"))
        age = process_age()
        self.data: dict = {"artifact": str(artifact), "imports_s": imports_s, "ready_s": ready_s,
                           "process_start_to_ready_s": age, "layerwise": layerwise}
        if stats is not None:
            self.data["breakdown"] = asdict(stats)
        if age is not None:
            self.rows.append(("process start to ready", f"{age:.2f} s"))

    def generation(self, res) -> None:
        """Add a timed generation (``generate_timed``'s result)."""
        if res.process_start_to_first_token_s is not None:
            self.rows.append(("process start to first token",
                              f"{res.process_start_to_first_token_s:.2f} s"))
        self.data.update(text=res.text, new_tokens=res.new_tokens, token_ids=res.token_ids,
                         tokenize_s=res.tokenize_s,
                         first_token_s=res.first_token_s, tokens_per_s=res.tokens_per_s,
                         process_start_to_first_token_s=res.process_start_to_first_token_s)
        self.rows += [("tokenizer load + prompt encode", f"{res.tokenize_s:.2f} s"),
                      ("first token (after the tokenizer)", f"{res.first_token_s:.2f} s"),
                      ("generation", f"{res.new_tokens} tokens, {res.tokens_per_s:.1f} tok/s")]

    def layerwise(self, model) -> None:
        """Add what a ``LayerwiseModel`` held at most, and the expert bytes it read."""
        from lct.units import human
        self.rows.append(("max resident layers", str(model.max_resident_layers)))
        self.data["max_resident_layers"] = model.max_resident_layers
        e = model.expert_stats
        self.data["expert_bytes"] = e
        if e["all"]:
            self.rows.append(("expert bytes read / all experts'",
                              f"{human(e['read'])} / {human(e['all'])} "
                              f"({e['read'] / e['all']:.1%}, {e['routed_groups']} of "
                              f"{e['routed_groups'] + len(e['whole_groups'])} experts groups "
                              f"by routing)"))

    def maximus(self, embedding) -> None:
        """Add a ``MaximusEmbedding``'s residency and hit rate."""
        e = embedding
        self.rows.append(("maximus", f"{len(e.resident)}/{e.num_shards} shards resident, "
                                     f"hit rate {e.stats.hit_rate:.1%}"))
        self.data["maximus"] = {"resident_shards": len(e.resident), "num_shards": e.num_shards,
                                "hit_rate": e.stats.hit_rate, "lookups": e.stats.lookups}

    def finish(self) -> None:
        """Add the process's peak memory (the last row)."""
        from lct.proc import peak_rss
        from lct.units import human
        self.rows.append(("peak RSS", human(peak_rss())))
        self.data["peak_rss_bytes"] = peak_rss()


def rank_report(rank: int, world: int, ready_s: float, stats, res=None) -> dict:
    """One tensor-parallel rank's JSON object (docs/CLI.md, ``lct load --tp --json``)."""
    from lct.proc import peak_rss, process_age
    out = {"rank": rank, "world_size": world, "ready_s": ready_s,
           "process_start_to_ready_s": process_age(), "bytes_read": stats.bytes_read,
           "bytes_decoded": stats.bytes_decoded, "peak_rss_bytes": peak_rss(),
           "notes": stats.notes}
    if res is not None:
        out.update(text=res.text, new_tokens=res.new_tokens, first_token_s=res.first_token_s,
                   process_start_to_first_token_s=res.process_start_to_first_token_s)
    return out
