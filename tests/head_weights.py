"""Small quantized LM-head weights for the kernel tests, in each encoding the heads take, with
their dequantized values: the float64 reference's weights and the chunked path's (rounded to
bfloat16 as the torch dequantize to a bfloat16 model does)."""

from dataclasses import dataclass

import numpy as np
import torch

from lct.format import int8, nf4, q6_k, q8_0

ENCODINGS = ("nf4", "int8", "int8_b128", "q8_0", "q6_k")


@dataclass
class HeadWeight:
    kind: str
    codes: torch.Tensor            # NF4 packed [n, k/2], int8 q [n, k], or the rows' blocks
    scales: torch.Tensor | None    # NF4 absmax [n, k/bs] float32, int8 scale [n] (int8_b128
                                   # [n, k/128]), else None
    blocksize: int                 # NF4's, int8_b128's, else 0
    w32: torch.Tensor              # [n, k] float32: each weight as its encoding defines it
    w16: torch.Tensor              # [n, k] bfloat16: the chunked path's weights

    @property
    def shape(self):
        return tuple(self.w32.shape)

    @property
    def tiled_kind(self) -> str:
        """The kind ``native.tiled_matmul`` knows it by (int8_b128: int8 with a blocksize)."""
        return "int8" if self.kind == "int8_b128" else self.kind

    def head(self, dtype=torch.bfloat16, bias=None, chunk_rows=None):
        """The encoding's ``QuantizedLinear`` over this weight."""
        from lct.kernels import Int8Linear, NF4Linear, Q6_KLinear, Q8_0Linear
        n, k = self.shape
        if self.kind == "nf4":
            return NF4Linear(self.codes, self.scales, n, k, self.blocksize, dtype, bias=bias,
                             chunk_rows=chunk_rows)
        if self.kind in ("int8", "int8_b128"):
            return Int8Linear(self.codes, self.scales, dtype, bias=bias, chunk_rows=chunk_rows)
        cls = Q8_0Linear if self.kind == "q8_0" else Q6_KLinear
        return cls(self.codes, dtype, bias=bias, chunk_rows=chunk_rows)

    def tiled_args(self):
        """``native.tiled_matmul``'s codes, scales, table and blocksize."""
        codes = self.codes.view(torch.uint8).numpy()
        scales = None if self.scales is None else self.scales.numpy()
        return codes, scales, nf4.code_array() if self.kind == "nf4" else None, self.blocksize


def q6_k_blocks(count: int, seed: int) -> torch.Tensor:
    """``count`` random valid Q6_K blocks (any codes and scales, a finite float16 d that keeps
    weights small), uint8 [count, 210]."""
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (count, 210), dtype=np.uint8)
    d = (rng.standard_normal(count) * 2e-4).astype(np.float16)
    b[:, 208:] = d.view(np.uint8).reshape(count, 2)
    return torch.from_numpy(b)


def weight(kind: str, n: int, k: int, seed: int = 0, blocksize: int = 64) -> HeadWeight:
    """A random ``kind`` weight [n, k] (k a multiple of the encoding's block)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.05).to(torch.bfloat16)
    if kind == "nf4":
        packed, absmax = nf4.quantize(w, blocksize)
        w32 = nf4.dequantize(packed, absmax, (n, k), blocksize, torch.float32)
        return HeadWeight(kind, packed.view(n, k // 2), absmax.view(n, k // blocksize).float(),
                          blocksize, w32, w32.to(torch.bfloat16))
    if kind in ("int8", "int8_b128"):
        block = 128 if kind == "int8_b128" else None
        q, scale = int8.quantize(w, block=block)
        w32 = int8.dequantize(q, scale, (n, k), torch.float32)
        return HeadWeight(kind, q, scale.float(), block or 0, w32,
                          int8.dequantize(q, scale, (n, k), torch.bfloat16))
    if kind == "q8_0":
        blocks = q8_0.quantize(w)
        w32 = q8_0.dequantize(blocks, (n, k))
    else:
        blocks = q6_k_blocks(n * k // 256, seed).reshape(n, -1)
        w32 = q6_k.dequantize(blocks, (n, k))
    return HeadWeight(kind, blocks, None, 0, w32, w32.to(torch.bfloat16))


def reference(x: torch.Tensor, w: HeadWeight) -> torch.Tensor:
    """``x @ W.T`` in float64 over the encoding's exact weights."""
    return x.double() @ w.w32.double().T


def chunked_error(x: torch.Tensor, w: HeadWeight, out_bf16: bool) -> float:
    """The chunked path's largest error against ``reference``: bfloat16 weights, float32 sums,
    output rounded to bfloat16 when ``out_bf16``."""
    got = x.float() @ w.w16.float().T
    if out_bf16:
        got = got.to(torch.bfloat16)
    return (got.double() - reference(x, w)).abs().max().item()
