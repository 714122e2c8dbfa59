"""The auto policy's calibration layer by layer, for a model of any size: the source model runs on
the calibration text with one decoder layer in memory at a time, read from the source's
safetensors files and computed in float32, so that its peak memory does not grow with the
model (issue 38).

The trunk is transformers' own: its base model's ``forward`` builds the masks and the rotary
tables and calls its decoder layers in order, and a hook on each layer reads that layer's
tensors just before it runs and lets them go right after (as ``lct.loader.layerwise`` streams
an artifact's layers). What the calibration compares needs neither table whole:

- the embedding only for the calibration tokens' rows (a quantized table's rows are its rows
  quantized: every lossy encoding quantizes within a row), looked up by the model's own
  embedding module over those rows (a scaled embedding scales them as it does);
- the head only on the trunk's final hidden states, a slice of its rows at a time through the
  model's own ``forward`` (the trunk's output given, so what follows the head, a logit
  soft-cap, runs as the model runs it).

The embedding candidates to measure and the reference run through the trunk together, one
batch row each: one read of the source's layers for all of them (``SourceTrunk.run``).
"""

from __future__ import annotations

from lct.errors import CalibrationUnavailable

# A table's rows are read, cast to float32 and quantized this many bytes (float32) at a time
# (the layer-wise calibration's head, the proxy's tables).
ROW_STEP_BYTES = 64 << 20
# The head stage's float32 logits of every variant at once hold at most this many bytes:
# positions are scored as many at a time as fit (the 256 shipped tokens of the reference and
# 10 candidates of a 152k vocabulary are 1.6 GB: one share, so the head is read once).
LOGIT_BYTES = 2 << 30
# What the calibration's progress calls the reference's pass (the whole-model path's name).
REFERENCE = "the source model as it is (the reference)"


class Swap:
    """Within ``with``, ``module.weight`` is ``w`` (a tied weight is untied for the while)."""

    def __init__(self, module, w):
        self.module, self.w = module, w

    def __enter__(self):
        import torch
        self.keep = self.module.weight
        self.module.weight = torch.nn.Parameter(self.w, requires_grad=False)

    def __exit__(self, *exc):
        self.module.weight = self.keep


class Cached:
    """Within ``with``, ``base`` (the model's trunk) returns ``output`` without computing."""

    def __init__(self, base, output):
        self.base, self.output = base, output

    def __enter__(self):
        self.base.forward = lambda *a, **k: self.output

    def __exit__(self, *exc):
        del self.base.forward


class SourceTrunk:
    """The source checkpoint's model (``model_class``, built from its config on the meta
    device, in ``dtype``: float32 by default), run on text with one decoder layer in memory:
    every layer is read from the safetensors files when the trunk reaches it and released
    after it. Only the tensors outside the layers, the embedding and the head (the final
    norm, rotary tables) are loaded; the two tables are read in rows (``embedding_rows``,
    ``head_slices``, which ``logits`` runs).

    Example:
        >>> with SourceTrunk(src, scan(src), type(arch.model)) as trunk:
        ...     h = trunk.run(trunk.embed(rows, ids))       # [variants, tokens, hidden]

    Raises:
        CalibrationUnavailable: the model has not one stack of decoder layers under a base
            model that takes ``inputs_embeds``, or a tensor it needs is not in the source.
    """

    def __init__(self, src, tensors: dict, model_class, on_layer=None, dtype=None):
        import inspect

        import torch

        from lct.arch import hf
        from lct.arch.model import Architecture
        self.src, self.tensors, self.on_layer = src, tensors, on_layer
        self._hooks: list = []
        self.dtype = dtype or torch.float32
        self._output = None
        arch = Architecture.from_config(hf.read_config(src.root), model_class, self.dtype,
                                        names=list(tensors))
        model, stack = arch.model.eval(), arch.main       # eval: no dropout
        base = model.base_model
        where = f"{src.root}: {arch.class_name}"
        if stack is None or len(arch.stacks) != 1 or base is model or \
                arch.embed is None or arch.head is None or \
                "inputs_embeds" not in inspect.signature(base.forward).parameters:
            raise CalibrationUnavailable(f"{where} is not one stack of decoder layers between "
                                         f"an embedding and a head, which the layer-wise "
                                         f"calibration runs")
        self.arch, self.model, self.base = arch, model, base
        self.embed_module = model.get_input_embeddings()
        self.head_module = model.get_output_embeddings()
        tables: dict = {}
        resident: list = []
        self._layers: dict = {}
        prefix = stack.path + "."
        for name in tensors:
            target = arch.target(name)[0]
            if target is None:
                continue
            if target in (arch.embed, arch.head):
                tables.setdefault(target, name)
            elif target.startswith(prefix):
                index = int(target[len(prefix):].partition(".")[0])
                self._layers.setdefault(index, []).append(name)
            else:
                resident.append(name)
        tied = arch.ties.get(arch.head) == arch.embed or arch.ties.get(arch.embed) == arch.head
        if arch.head not in tables and tied and arch.embed in tables:
            tables[arch.head] = tables[arch.embed]
        if arch.embed not in tables and tied and arch.head in tables:
            tables[arch.embed] = tables[arch.head]
        if arch.embed not in tables or arch.head not in tables:
            raise CalibrationUnavailable(f"{where}: the source holds no "
                                         f"{'embedding' if arch.embed not in tables else 'head'}")
        self.embed_name, self.head_name = tables[arch.embed], tables[arch.head]
        self._install(self._read(resident))
        skip = {arch.embed, arch.head}
        left = [n for n, p in model.named_parameters(remove_duplicate=False)
                if p.is_meta and n not in skip and not n.startswith(prefix)
                and arch.ties.get(n) not in skip]
        if left:
            raise CalibrationUnavailable(f"{where}: no source tensor fills {left[0]!r}")
        layers = model.get_submodule(stack.path)
        if sorted(self._layers) != list(range(len(layers))):
            raise CalibrationUnavailable(f"{where}: the source holds tensors of "
                                         f"{len(self._layers)} of its {len(layers)} layers")
        self.layers = len(layers)
        self._held: dict = {}
        self._pool: dict = {}
        for index, module in enumerate(layers):
            self._hooks.append(module.register_forward_pre_hook(self._pre(index)))
            self._hooks.append(module.register_forward_hook(self._post(index)))

    # Reading --------------------------------------------------------------------------------
    # Each read opens the files it reads and closes them after, as the converter does: a file
    # kept open keeps the pages it mapped in the process's resident set (RSS counts them), and
    # over a pass that is the whole checkpoint.
    def _open(self, name: str):
        from safetensors import safe_open
        return safe_open(str(self.src.root / self.tensors[name].file), framework="pt")

    def _read(self, names) -> dict:
        by_file: dict = {}
        for n in names:
            by_file.setdefault(self.tensors[n].file, []).append(n)
        out = {}
        for group in by_file.values():
            with self._open(group[0]) as f:
                out.update({n: f.get_tensor(n) for n in group})
        return out

    def _install(self, tensors: dict, pool: dict | None = None) -> list:
        """Put checkpoint ``tensors`` into the model (renamed and converted as
        ``from_pretrained`` does), floating-point ones in float32 (copied into a buffer of
        ``pool``, ``{(shape, dtype): [free tensors]}``, where one is free); returns what they
        replaced, ``[(module, leaf, old, is_buffer, new)]``."""
        import torch
        replaced = []
        for full, t in self.arch.to_model(tensors, where=str(self.src.root)).items():
            mod_path, _, leaf = full.rpartition(".")
            module = self.model.get_submodule(mod_path) if mod_path else self.model
            buffer = leaf in module._buffers
            old = module._buffers[leaf] if buffer else module._parameters.get(leaf)
            if t.is_floating_point():
                want = old.dtype if old is not None and old.is_floating_point() else self.dtype
                free = pool.get((tuple(t.shape), want)) if pool is not None else None
                t = free.pop().copy_(t) if free else t.to(want)
            if buffer:
                module._buffers[leaf] = t
            else:
                module._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
            replaced.append((module, leaf, old, buffer, t))
        return replaced

    # A layer's float32 tensors go back to a pool when it has run and the next layer's are
    # copied into them: fresh memory for every layer of every pass costs a page fault a page
    # (1-2 s a GB on this project's VMs, docs/BENCHMARKS.md), reused memory none.
    def _pre(self, index: int):
        def pre(module, args):
            self._held[index] = self._install(self._read(self._layers[index]), self._pool)
        return pre

    def _post(self, index: int):
        def post(module, args, output):
            for mod, leaf, old, buffer, new in reversed(self._held.pop(index, [])):
                (mod._buffers if buffer else mod._parameters)[leaf] = old
                if new.is_floating_point():
                    self._pool.setdefault((tuple(new.shape), new.dtype), []).append(new)
            if self.on_layer is not None:
                self.on_layer(index)
        return post

    def embedding_rows(self, ids):
        """The embedding's rows ``ids`` (sorted, unique) as the source stores them."""
        import torch
        with self._open(self.embed_name) as f:
            piece = f.get_slice(self.embed_name)
            return torch.cat([piece[i:i + 1] for i in ids])

    def head_slices(self):
        """``(r0, rows)``: the head's rows as the source stores them, ``ROW_STEP_BYTES`` (in
        float32) at a time."""
        rows, cols = self.tensors[self.head_name].shape
        step = max(1, ROW_STEP_BYTES // (4 * cols))
        for r0 in range(0, rows, step):
            with self._open(self.head_name) as f:      # a slice's pages, then let go
                rows_read = f.get_slice(self.head_name)[r0:r0 + step]
            yield r0, rows_read

    # Running --------------------------------------------------------------------------------
    def embed(self, table, ids):
        """The model's embedding module over ``table`` (float32 rows) for ``ids`` [T], indices
        into it: ``[1, T, hidden]``, scaled as the module scales."""
        import torch
        with torch.no_grad(), Swap(self.embed_module, table):
            return self.embed_module(ids[None])

    def run(self, embeds):
        """The trunk's final hidden states (after its final norm) for ``embeds``
        ``[variants, T, hidden]``, each batch row a sequence of its own."""
        import torch
        try:
            with torch.no_grad():
                out = self.base(inputs_embeds=embeds, use_cache=False)
        finally:
            self._pool.clear()      # the layers' buffers serve one pass, not what follows it
        self._output = type(out)     # what ``logits`` gives the model's forward as it
        return out[0] if isinstance(out, tuple) else out.last_hidden_state

    def logits(self, hiddens: list, encodings: list, blocksize: int | None = None) -> list:
        """The head's logits ``[N_i, vocab]`` on each of the final hidden states ``hiddens``
        ([N_i, hidden]), with the head's rows as the source stores them (encoding None) or
        quantized in ``encodings[i]`` and dequantized (``blocksize``: NF4's), through the
        model's own ``forward`` on that trunk output (so a logit soft-cap applies as it does).
        The head's rows are read once for all, a ``ROW_STEP_BYTES`` slice at a time, and each
        encoding quantizes a slice once."""
        import torch

        from lct.format.encodings import get_encoding
        rows = self.tensors[self.head_name].shape[0]
        outs = [torch.empty(h.shape[0], rows) for h in hiddens]
        bias = getattr(self.head_module, "bias", None)
        # the trunk's output as the trunk gives it (its own output class), holding each hidden
        kept = [(h[None],) if self._output is tuple else self._output(last_hidden_state=h[None])
                for h in hiddens]
        with torch.no_grad():
            for r0, stored in self.head_slices():
                wf = stored.to(torch.float32)
                r1 = r0 + wf.shape[0]
                ws = {e: (wf if e is None else get_encoding(e).roundtrip(
                    stored, blocksize, wf).to(torch.float32)).to(self.dtype)
                    for e in dict.fromkeys(encodings)}
                if bias is not None:
                    self.head_module.bias = torch.nn.Parameter(bias[r0:r1], requires_grad=False)
                try:
                    for out, h, e, k in zip(outs, hiddens, encodings, kept):
                        ids = torch.zeros(1, h.shape[0], dtype=torch.long)
                        with Cached(self.base, k), Swap(self.head_module, ws[e]):
                            out[:, r0:r1] = self.model(ids).logits[0].float()
                finally:
                    if bias is not None:
                        self.head_module.bias = bias
                del ws, wf
        return outs

    def scorer(self, x):
        """For ids ``x`` [1, T]: a callable ``at -> logits [len(at), vocab]`` of the positions
        ``at``, the trunk run once (``lct.conversion.quality.score`` takes it as the
        reference's).

        Raises:
            LCTError: an id past the embedding's rows.
        """
        import torch

        from lct.errors import LCTError
        ids = x[0].tolist()
        rows = self.tensors[self.embed_name].shape[0]
        if max(ids) >= rows:
            raise LCTError(f"{self.src.root}: token id {max(ids)} is past the source's "
                           f"{rows}-row embedding")
        used = sorted(set(ids))
        index = {t: k for k, t in enumerate(used)}
        table = self.embedding_rows(used).to(self.dtype)
        hidden = self.run(self.embed(table, torch.tensor([index[i] for i in ids])))[0]
        return lambda at: self.logits([hidden[at]], [None])[0]

    def close(self) -> None:
        """Remove the hooks (the source's files are open only while a read runs)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def layerwise_costs(src, tensors: dict, model_class, plan: dict, blocks: list, blocksize: int,
                    bound: float, prune: bool, passes) -> tuple:
    """Costs per part and candidate on the token ``blocks``, as the whole-model calibration
    (``lct.conversion.policy.calibration_costs``) measures them: the same mean KL against the
    source model, with the source run layer by layer (see the module docstring).

    Args:
        plan: ``{part: (roles, source tensor, candidates in the registry's order,
            candidates smallest first)}``, the policy's (``"embed+head"``, ``"embed"``,
            ``"head"``).
        bound: what a candidate's estimate must be within (the budget over its margin).
        prune: a tied table of an auto policy: a candidate's embedding is left out where its
            head alone is over ``bound`` or a smaller candidate fits (its cost is then its
            head's, a lower bound, and it is listed in ``partial``), as the whole-model path
            leaves it out.
        passes: the calibration's progress (``policy._Passes``), told the trunk's tokens after
            each layer.

    One trunk pass runs the reference and every embedding candidate together; with ``prune``
    the reference runs alone, then the smallest embedding that can change the choice (its head
    alone within ``bound``) and, where it does not fit, every other that can in one more pass:
    the embeddings the whole-model path measures, in at most three passes.

    Returns ``(costs, tokens scored, partial)``.

    Raises:
        CalibrationUnavailable: the model cannot run layer by layer here (``SourceTrunk``),
            or its tokenizer's ids pass its embedding.
    """
    import torch

    from lct.format.encodings import get_encoding
    with SourceTrunk(src, tensors, model_class) as trunk:
        rows = tensors[trunk.embed_name].shape[0]
        top = max(max(ids) for ids in blocks)
        if top >= rows:
            raise CalibrationUnavailable(f"{src.root}: its tokenizer gives token id {top}, past "
                                         f"the model's {rows}-row embedding: the tokenizer does "
                                         f"not match the model")
        used = sorted({i for ids in blocks for i in ids})
        index = {t: k for k, t in enumerate(used)}
        local = [torch.tensor([index[i] for i in ids]) for ids in blocks]
        stored_rows = trunk.embedding_rows(used)
        sweep = sum(len(ids) for ids in blocks)
        n = sum(len(ids) - 1 for ids in blocks)
        embed_part = next((p for p, (roles, *_) in plan.items() if "embed" in roles), None)
        embed_cands = plan[embed_part][3] if embed_part else []
        # without pruning every embedding runs beside the reference; with it, none: which
        # can change the choice is known once the head's costs are
        first = [] if prune else embed_cands

        def table(e):
            wf = stored_rows.float()
            return wf if e is None else \
                get_encoding(e).roundtrip(stored_rows, blocksize, wf).to(torch.float32)

        def trunk_pass(cands, reference: bool = True):
            """Final hidden states ``{candidate or None: [N, hidden]}`` of the scored
            positions of every block, of the reference (None; not with ``reference=False``)
            and each embedding candidate, told to ``passes`` a layer at a time."""
            keys = [None] * reference + list(cands)
            whats = [REFERENCE] * reference + [f"{label(e, embed_part)}: embed (layer by layer)"
                                               for e in cands]
            tables = [table(e) for e in keys]
            out = {k: [] for k in keys}
            for ids in local:
                x = torch.cat([trunk.embed(t, ids) for t in tables])

                def on_layer(i, t=len(ids)):
                    for what in whats:
                        passes.ran(what, t * (i + 1) // trunk.layers - t * i // trunk.layers)
                trunk.on_layer = on_layer
                try:
                    h = trunk.run(x)
                finally:
                    trunk.on_layer = None
                for k, row in zip(keys, h):
                    out[k].append(row[:-1])
            return {k: torch.cat(v) for k, v in out.items()}

        def label(e, part):
            return f"{get_encoding(e).label} on {part}"

        passes.say(REFERENCE)
        hidden = trunk_pass(first)
        head_stage = []
        for part, (roles, st, order, cands) in plan.items():
            if "head" in roles:
                head_stage += [(e, part) for e in cands]
        measured = {}     # (kind, encoding) -> mean KL
        reference: dict = {}    # the reference's log-probabilities, kept where they are small
        _score(trunk, hidden[None], [(("embed", e), hidden[e], None) for e in first] +
               [(("head", e), hidden[None], e) for e, _ in head_stage],
               measured, n, blocksize, passes, sweep, label, head_stage, reference)
        def walk(skip: bool) -> tuple:
            """Each part's costs as ``calibration_costs`` walks them (smallest first; a tied
            table's embedding left out where its head alone is over the budget or a smaller
            candidate fits); ``(costs, partial, embeddings still to measure)``."""
            costs, partial, pending = {}, {}, []
            for part, (roles, st, order, cands) in plan.items():
                c, fits = {}, False
                for e in cands:
                    c[e] = measured[("head", e)] if "head" in roles else 0.0
                    if "embed" not in roles:
                        continue
                    if prune and (fits or not c[e] <= bound):
                        partial.setdefault(part, []).append(e)
                        if skip and ("embed", e) not in measured:
                            passes.skip(f"{label(e, part)}: embed left out (cannot change "
                                        f"the choice)", sweep)
                    elif ("embed", e) in measured:
                        c[e] += measured[("embed", e)]
                        fits = fits or c[e] <= bound
                    else:
                        pending.append(e)
                        fits = None if fits is False else fits    # not known before it runs
                costs[part] = c
            return costs, partial, pending

        # A tied table: the smallest embedding that can change the choice, then, where it
        # does not fit, every other that can at once (at most two more passes).
        for round_ in range(2):
            pending = walk(skip=False)[2]
            if not pending:
                break
            batch = pending[:1] if round_ == 0 else pending
            more = trunk_pass(batch, reference=False)
            _score(trunk, hidden[None], [(("embed", e), more[e], None) for e in batch],
                   measured, n, blocksize, passes, 0, label, [], reference)
        costs, partial, _ = walk(skip=True)
        return ({part: {e: costs[part][e] for e in plan[part][2]} for part in plan}, n,
                partial)


def _score(trunk, ref_hidden, variants, measured: dict, n: int, blocksize: int, passes,
           sweep: int, label, head_stage, reference: dict) -> None:
    """Mean KL over the ``n`` scored positions of each ``(key, hidden, head encoding)`` of
    ``variants`` against the reference (the unquantized head on ``ref_hidden``), into
    ``measured[key]``: the logits of every variant from one read of the head's rows, as many
    positions at a time as ``LOGIT_BYTES`` holds for all of them. Where the positions are one
    such share, the reference's log-probabilities are kept in ``reference`` for the next call."""
    from torch.nn import functional as F
    vocab = trunk.tensors[trunk.head_name].shape[0]
    step = max(1, LOGIT_BYTES // (4 * vocab * (len(variants) + 1)))
    totals = {key: 0.0 for key, _, _ in variants}
    for p0 in range(0, n, step):
        cached = reference.get(p0)
        hiddens = [h[p0:p0 + step] for _, h, _ in variants]
        encodings = [e for _, _, e in variants]
        if cached is None:
            hiddens.insert(0, ref_hidden[p0:p0 + step])
            encodings.insert(0, None)
        outs = trunk.logits(hiddens, encodings, blocksize)
        del hiddens
        if cached is None:
            lr = F.log_softmax(outs.pop(0), -1)
            pr = lr.exp()
            if step >= n:
                reference[p0] = lr, pr
        else:
            lr, pr = cached
        for key, _, _ in variants:
            lq = F.log_softmax(outs.pop(0), -1)     # each variant's logits let go once used
            totals[key] += float((pr * (lr - lq)).sum())
            del lq
        del lr, pr
    for key, hidden, e in variants:
        measured[key] = totals[key] / n
    for e, part in head_stage:
        passes.say(f"{label(e, part)}: quantizing")
        passes.ran(f"{label(e, part)}: head", sweep)
