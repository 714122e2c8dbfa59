"""The quantized LM heads' shared forward (``QuantizedLinear``: the CPU path chosen among the
compiled fused and tiled kernels and torch's chunked dequantize-and-matmul, whose memory does not
grow with the vocabulary beyond one chunk), the head over an NF4 weight (on CUDA bitsandbytes'
4-bit matmul), and the dense head that hands torch 2-D input."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from lct.errors import OptionError
from lct.format import constants as C
from lct.kernels.embedding import NF4Embedding
from lct.kernels.nf4 import dequantize_rows, dequantize_rows_into, quant_state
from lct.kernels.registry import register_kernels

# The dtypes of input and output the compiled kernels take (others go the torch way).
_NATIVE_DTYPES = (torch.bfloat16, torch.float32)

# Dequantized rows per CPU chunk are capped by bytes: 128 MiB is 32,768 rows of a 2048-wide bf16
# head. Fewer, larger chunks matter on the CPU: after every matmul torch's OpenMP threads spin a
# while and slow the next chunk's dequantize (8,192 rows: 0.72 s per 256k x 2048 forward;
# 32,768: 0.52 s).
DEFAULT_CHUNK_BYTES = C.NF4_HEAD_CHUNK_BYTES


def native_call(x2: torch.Tensor, n: int, out_dtype: torch.dtype, run) -> torch.Tensor:
    """Prepare a compiled matmul's buffers and call it: ``x2`` [M, K] made contiguous in
    bfloat16 or float32, an ``out_dtype`` [M, n] output, then ``run(x, x_bf16, out, out_bf16)``
    with numpy views (bfloat16 as its int16 bits)."""
    if x2.dtype not in _NATIVE_DTYPES:
        x2 = x2.float()
    x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=out_dtype)
    xb, ob = x2.dtype == torch.bfloat16, out_dtype == torch.bfloat16
    run(x2.view(torch.int16).numpy() if xb else x2.numpy(), xb,
        out.view(torch.int16).numpy() if ob else out.numpy(), ob)
    return out


def chunked_linear(mod, x2: torch.Tensor, odt: torch.dtype, r0: int, r1: int) -> torch.Tensor:
    """Output rows ``r0:r1`` of ``mod`` (a ``QuantizedLinear``) the torch way: ``chunk_rows``
    rows at a time dequantized to ``odt`` into one scratch buffer (fresh pages cost more than
    the dequantize), then ``F.linear`` with the bias. The path for very many input rows, without
    the compiled module, and on a GPU."""
    k = mod.in_features
    out = x2.new_empty(x2.shape[0], r1 - r0, dtype=odt)
    size = min(mod.chunk_rows, r1 - r0) * k
    scratch = torch.empty(size, dtype=odt, device=x2.device)
    dequantize = mod._dequantizer(odt, size, x2.device)
    xo = x2.to(odt)
    for a in range(r0, r1, mod.chunk_rows):
        b = min(r1, a + mod.chunk_rows)
        w = dequantize(a, b, scratch[:(b - a) * k])
        out[:, a - r0:b - r0] = F.linear(xo, w.view(b - a, k),
                                         None if mod.bias is None else mod.bias[a:b].to(odt))
    return out


def run_path(mod, path: str, x2: torch.Tensor, odt: torch.dtype, r0: int = 0,
             r1: int | None = None) -> torch.Tensor:
    """Output rows ``r0:r1`` (default all) of ``mod`` for ``x2`` [M, K] by ``path`` (one of
    ``paths.PATHS``), in ``odt``. A compiled path with a bias sums it in float32 and rounds once,
    as ``F.linear`` does."""
    r1 = mod.out_features if r1 is None else r1
    if path == "chunked":
        return chunked_linear(mod, x2, odt, r0, r1)
    bias = None if mod.bias is None else mod.bias[r0:r1]
    w_bf16 = odt == torch.bfloat16  # the torch path would round the weights to it too
    out = native_call(x2, r1 - r0, odt if bias is None else torch.float32,
                      lambda x, xb, out, ob: mod._native(path, x, xb, out, ob, r0, r1, w_bf16))
    return out if bias is None else out.add_(bias).to(odt)


def choose_path(mod, x2: torch.Tensor, odt: torch.dtype) -> str:
    """The path ``mod`` takes for ``x2``: ``chunked`` where the compiled kernels cannot run
    (not built or ``LCT_NATIVE=0``, not on the CPU, an output dtype they do not write, an
    encoding they do not have, ``mod.compiled``), else the
    forced path (``paths.force``, ``LCT_HEAD_PATH``), else ``paths.choose``'s measured one,
    timed on slices of this head with the first ``MEASURE_ROWS`` rows of ``x2``."""
    from lct.kernels import native, paths
    rows = x2.shape[0]
    if x2.device.type != "cpu" or not native.available() or odt not in _NATIVE_DTYPES \
            or rows == 0 or not mod.compiled:
        return "chunked"
    forced = paths.forced()
    if forced is not None:
        return forced
    n, k = mod.out_features, mod.in_features
    key = (mod.encoding, k, n, str(x2.dtype), str(odt), torch.get_num_threads(),
           paths.bucket(rows))
    xm = x2[:paths.MEASURE_ROWS]
    part = paths.slice_rows(n, k, rows)
    parts = max(1, n // part)
    return paths.choose(key, lambda path, i: run_path(mod, path, xm, odt, i % parts * part,
                                                      i % parts * part + part))


def quantized_forward(mod, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a ``QuantizedLinear`` by the path ``choose_path`` gives. Always
    on 2-D input: torch's CPU linear of a 3-D input (generate's prefill slice
    ``hidden[:, -1:, :]`` above all) takes a path 100x slower than the same data as 2-D."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, mod.in_features)
    odt = torch.result_type(x, torch.empty(0, dtype=mod.dtype))
    out = run_path(mod, choose_path(mod, x2, odt), x2, odt)
    return out.view(*lead, mod.out_features)


class QuantizedLinear(nn.Module):
    """What the quantized LM heads share: ``y = x @ W.T (+ bias)`` with ``W`` [out_features,
    in_features] kept encoded, computed by the path ``choose_path`` picks (fused, tiled or
    chunked; ``kernels/paths.py``).

    A subclass sets ``in_features``, ``out_features``, ``dtype`` (the weight's when
    dequantized), ``bias`` and ``chunk_rows``, names its ``encoding`` (the path chooser's key),
    and gives ``_dequantizer(dtype, elements, device)``: a function ``(r0, r1, out)`` writing
    rows ``r0:r1`` dequantized into ``out`` (the chunked path; up to ``elements`` values), and
    ``_native(path, x, x_bf16, out, out_bf16, r0, r1, w_bf16)``: the compiled fused or tiled
    kernel on rows ``r0:r1`` (numpy buffers as ``native_call`` gives them), where
    ``compiled`` (the compiled kernels have its encoding; else it takes the chunked path).
    """

    encoding = ""
    compiled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantized_forward(self, x)


class NF4Linear(QuantizedLinear):
    """``y = x @ W.T`` with ``W`` [out_features, in_features] kept in NF4; on CUDA through
    bitsandbytes' 4-bit matmul.

    Args:
        packed, absmax: the NF4 weight in bitsandbytes layout (blocksize divides in_features).
        chunk_rows: output rows dequantized at a time on the chunked path (default: as many as
            fit in ``DEFAULT_CHUNK_BYTES`` of ``dtype``).
    """

    encoding = C.ENCODING_NF4

    def __init__(self, packed, absmax, out_features: int, in_features: int, blocksize: int,
                 dtype: torch.dtype, bias: torch.Tensor | None = None,
                 chunk_rows: int | None = None):
        super().__init__()
        if in_features % blocksize:
            raise OptionError(f"blocksize {blocksize} must divide in_features {in_features}",
                              option="blocksize")
        self.in_features, self.out_features = in_features, out_features
        if chunk_rows is None:
            width = in_features * dtype.itemsize
            chunk_rows = max(1, DEFAULT_CHUNK_BYTES // width)
        self.blocksize, self.dtype, self.chunk_rows = blocksize, dtype, chunk_rows
        self.register_buffer("packed", packed.reshape(out_features, in_features // 2))
        self.register_buffer("absmax", absmax.reshape(out_features, in_features // blocksize))
        self.bias = bias

    @classmethod
    def from_weight(cls, weight, dtype: torch.dtype, bias=None) -> NF4Linear:
        """Over a stored ``NF4Weight`` (``lct.kernels.registry.Kernels``)."""
        rows, cols = weight.shape
        return cls(weight.packed, weight.absmax, rows, cols, weight.blocksize, dtype, bias=bias)

    @property
    def weight(self) -> torch.Tensor:
        """The whole weight dequantized (costs memory; forward never builds it on CPU)."""
        return dequantize_rows(self.packed, self.absmax, self.blocksize, self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            import bitsandbytes as bnb
            state = quant_state(self.absmax.reshape(-1), (self.out_features, self.in_features),
                                self.blocksize, self.dtype)
            return bnb.matmul_4bit(x.to(self.dtype), self.packed.reshape(-1, 1).t(),
                                   quant_state=state, bias=self.bias)
        return quantized_forward(self, x)

    def _dequantizer(self, dtype, elements, device):
        return lambda r0, r1, out: dequantize_rows_into(self.packed[r0:r1], self.absmax[r0:r1],
                                                        self.blocksize, dtype, out)

    def _native(self, path, x, xb, out, ob, r0, r1, w_bf16):
        from lct.format.nf4 import code_array
        from lct.kernels import native
        packed = self.packed[r0:r1].contiguous().numpy()
        absmax = self.absmax[r0:r1].float().contiguous().numpy()
        shape = (x.shape[0], r1 - r0, self.in_features)
        threads = torch.get_num_threads()
        if path == "fused":
            native.nf4_matmul(x, xb, packed, absmax, code_array(), out, ob, shape,
                              self.blocksize, threads)
        else:
            native.tiled_matmul("nf4", x, xb, packed, absmax, code_array(), out, ob, shape,
                                self.blocksize, w_bf16, threads)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"nf4 blocksize={self.blocksize}, chunk_rows={self.chunk_rows}")


register_kernels(C.ENCODING_NF4, embedding=NF4Embedding.from_weight, linear=NF4Linear.from_weight)
