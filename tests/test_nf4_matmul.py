"""The fused NF4 matmul (CPU head) against a float64 reference, on every instruction set this CPU
runs and through the fallback; LM heads give the same result whatever the input's strides."""

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from lct.format import nf4
from lct.kernels import FlatLinear, NF4Linear, flatten_head, native, paths
from lct.kernels import linear as klin


@pytest.fixture(autouse=True)
def _fresh_paths():
    paths.reset()
    yield
    paths.force(None)
    paths.reset()


def _isas():
    if not native.available():
        return []
    best = native.ISAS.index(native.matmul_isa())
    return list(native.ISAS[: best + 1])


def _weight(n, k, bs, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    packed, absmax = nf4.quantize(w, bs)
    return packed.view(n, k // 2), absmax.view(n, k // bs).float()


def _errors(x, packed, absmax, bs, got):
    """Max |got - ref| and max |bf16 dequantized path - ref|, ref in float64 from the float32
    dequantized weight."""
    n, k = packed.shape[0], packed.shape[1] * 2
    w32 = nf4.dequantize(packed.reshape(-1), absmax.reshape(-1), (n, k), bs, torch.float32)
    w16 = nf4.dequantize(packed.reshape(-1), absmax.reshape(-1), (n, k), bs, torch.bfloat16)
    ref = x.double() @ w32.double().T
    bf16 = F.linear(x, w16)
    return (got.double() - ref).abs().max().item(), (bf16.double() - ref).abs().max().item()


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("n,k,bs", [(1000, 256, 64), (4099, 128, 32), (333, 512, 128),
                                    (17, 64, 64), (50, 96, 32), (31, 40, 8)])
@pytest.mark.parametrize("m", [1, 2, 7, 64])
def test_fused_matmul_within_the_bf16_paths_error(isa, n, k, bs, m):
    if isa not in _isas():
        pytest.skip(f"{isa} is not available on this CPU (or the extension is not built)")
    packed, absmax = _weight(n, k, bs, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    native.nf4_matmul(x.view(torch.int16).numpy(), True, packed.numpy(), absmax.numpy(),
                      nf4.code_array(), out.view(torch.int16).numpy(), True, (m, n, k), bs, 3, isa)
    fused, bf16 = _errors(x, packed, absmax, bs, out)
    assert fused <= bf16 * 1.01 + 1e-6, (fused, bf16)
    # float32 output and float32 input: accumulation error only, far below bf16 rounding
    out32 = torch.empty(m, n)
    native.nf4_matmul(x.float().numpy(), False, packed.numpy(), absmax.numpy(),
                      nf4.code_array(), out32.numpy(), False, (m, n, k), bs, 2, isa)
    ref32 = x.double() @ nf4.dequantize(packed.reshape(-1), absmax.reshape(-1), (n, k), bs,
                                        torch.float32).double().T
    assert (out32.double() - ref32).abs().max().item() <= 1e-5 * max(1.0, ref32.abs().max().item())


def test_every_isa_agrees_and_threads_do_not_change_the_result():
    isas = _isas()
    if not isas:
        pytest.skip("the extension is not built")
    packed, absmax = _weight(777, 256, 64)
    x = torch.randn(3, 256).float()
    outs = []
    for isa in isas:
        for threads in (1, 2, 5):
            out = torch.empty(3, 777)
            native.nf4_matmul(x.numpy(), False, packed.numpy(), absmax.numpy(), nf4.code_array(),
                              out.numpy(), False, (3, 777, 256), 64, threads, isa)
            outs.append((isa, threads, out))
    for isa, threads, out in outs:
        same_isa = [o for i, t, o in outs if i == isa]
        assert all(torch.equal(out, o) for o in same_isa)  # rows are split, never reordered
        assert torch.allclose(out, outs[0][2], rtol=1e-5, atol=1e-6)


def test_fused_matmul_rejects_mismatched_buffers():
    if not native.available():
        pytest.skip("the extension is not built")
    packed, absmax = _weight(8, 64, 64)
    x, out = np.zeros((1, 64), np.float32), np.zeros((1, 8), np.float32)
    with pytest.raises(ValueError, match="buffer sizes"):
        native.nf4_matmul(x, False, packed.numpy()[:4], absmax.numpy(), nf4.code_array(), out,
                          False, (1, 8, 64), 64, 1)
    with pytest.raises(ValueError, match="bad shape"):
        native.nf4_matmul(x, False, packed.numpy(), absmax.numpy(), nf4.code_array(), out,
                          False, (1, 8, 64), 48, 1)


@pytest.mark.parametrize("path", [None, *paths.PATHS])
@pytest.mark.parametrize("m", [1, 2, 7, 64])
def test_nf4_linear_native_and_fallback(native_mode, m, path):
    """Through NF4Linear, by the measured path (None) and each forced one: all within the bf16
    path's error; the chunked path, and every path without the compiled module, equals it
    exactly."""
    n, k, bs = 1001, 128, 64
    packed, absmax = _weight(n, k, bs)
    head = NF4Linear(packed, absmax, n, k, bs, torch.bfloat16, chunk_rows=300)
    x = torch.randn(m, k).to(torch.bfloat16)
    paths.force(path)
    got = head(x)
    fused, bf16 = _errors(x, packed, absmax, bs, got)
    assert fused <= bf16 * 1.01 + 1e-6
    if native_mode == "numpy" or path == "chunked":
        w16 = nf4.dequantize(packed.reshape(-1), absmax.reshape(-1), (n, k), bs, torch.bfloat16)
        assert torch.equal(got, F.linear(x, w16))


def _sliced():
    h = torch.randn(2, 6, 128).to(torch.bfloat16)
    return h[:, -1:, :]  # what generate's prefill hands the head: batch stride 6 * H


@pytest.mark.parametrize("path", paths.PATHS)
def test_nf4_head_sliced_input_equals_fresh_2d(path):
    paths.force(path)
    packed, absmax = _weight(500, 128, 64)
    head = NF4Linear(packed, absmax, 500, 128, 64, torch.bfloat16)
    x = _sliced()
    fresh = x.contiguous().clone().reshape(-1, 128)
    got = head(x)
    assert got.shape == (2, 1, 500)
    assert torch.equal(got.reshape(-1, 500), head(fresh))


def test_dense_head_sliced_input_equals_fresh_2d():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(128, 500, bias=True).to(torch.bfloat16)

        def get_output_embeddings(self):
            return self.lm_head

    model = Model()
    flatten_head(model)
    assert isinstance(model.lm_head, FlatLinear) and "lm_head.weight" in model.state_dict()
    x = _sliced()
    got = model.lm_head(x)
    ref = F.linear(x.contiguous().clone().reshape(-1, 128), model.lm_head.weight,
                   model.lm_head.bias)
    assert got.shape == (2, 1, 500) and torch.equal(got.reshape(-1, 500), ref)


def test_heads_never_hand_torch_a_3d_input(monkeypatch):
    """The regression guard for the 4 s prefill head: whatever generate passes, torch's linear
    sees 2-D activations (dense FlatLinear and every NF4Linear path)."""
    seen = []
    real = F.linear
    monkeypatch.setattr(klin.F, "linear", lambda x, w, b=None: seen.append(x.dim()) or real(x, w, b))
    packed, absmax = _weight(300, 128, 64)
    dense = torch.nn.Linear(128, 300).to(torch.bfloat16)
    dense.__class__ = FlatLinear
    for path in paths.PATHS:
        paths.force(path)
        NF4Linear(packed, absmax, 300, 128, 64, torch.bfloat16, chunk_rows=100)(_sliced())
    dense(_sliced())
    assert seen and set(seen) == {2}


def test_loaded_parameters_require_grad_like_from_pretrained(llama_src, llama_art):
    """from_pretrained's floating-point parameters require grad, and torch's CPU linear picks its
    kernel by that; a loaded model matches it."""
    from transformers import AutoModelForCausalLM

    import lct
    ref = AutoModelForCausalLM.from_pretrained(llama_src, dtype=torch.bfloat16)
    model = lct.load(llama_art, nf4="dequantize")
    want = {n: p.requires_grad for n, p in ref.named_parameters()}
    got = {n: p.requires_grad for n, p in model.named_parameters()}
    assert got == want and all(got.values())
