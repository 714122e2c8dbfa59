"""vLLM's ``--load-format lct``: serve an LCT artifact with vLLM.

``pip install 'lct[vllm]'`` registers ``register`` under vLLM's ``vllm.general_plugins`` entry
point, which vLLM calls in every one of its processes (the front end, the engine core, each
worker); it registers ``LCTModelLoader`` as load format ``lct``. The loader opens the artifact
and feeds LCT's prefetching group stream into the model's own ``load_weights``: pairs of
(checkpoint name, tensor), as vLLM's default loader feeds safetensors, so the model maps the
names (fused qkv, gate_up, experts) itself. Chunks are checked as they are read (``verify``);
lossless tensors are handed over bit-exact in their stored dtype (the parameter's loader casts
them, as it casts a safetensors tensor); the NF4/int8 tables are dequantized, in the dtype the
artifact names for them, and cast to the serving dtype: the values ``lct export`` writes.
Tied names are not yielded (the safetensors checkpoint held the tensor once; vLLM's models tie
themselves). A damaged chunk raises LCT's ``ChecksumError`` / ``CorruptChunkError``, which
stops the engine before anything serves.

Example:
    >>> from vllm import LLM
    >>> llm = LLM(model="gemma-2b.lct", load_format="lct",
    ...           model_loader_extra_config={"prefetch": 4})

    or ``vllm serve gemma-2b.lct --load-format lct``, with
    ``--model-loader-extra-config '{"verify": false}'`` for options.

Options (``model_loader_extra_config``): ``prefetch`` (groups decoded ahead, default
``lct.io.stream.DEFAULT_PREFETCH``), ``workers`` (decode threads, default all cores),
``verify`` (check every chunk's checksum, default True).

The model's folder is an artifact folder (vLLM reads its config.json and tokenizer before any
loader runs); ``hf://org/name[@revision]`` is resolved by ``download_model`` (pulled and
checked), but vLLM itself does not read a config from such an address.
"""

from __future__ import annotations

import time

from lct.errors import ArchitectureError, MissingDependencyError, OptionError
from lct.io.stream import DEFAULT_PREFETCH

try:
    from vllm.logger import init_logger
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
except ImportError as e:                                    # pragma: no cover
    raise MissingDependencyError(f"vLLM is required for --load-format lct ({e}): "
                                 f"pip install 'lct[vllm]'") from e

LOAD_FORMAT = "lct"
# model_loader_extra_config keys the loader takes, and their defaults.
DEFAULTS = {"prefetch": DEFAULT_PREFETCH, "workers": None, "verify": True}

# Under "vllm." so that vLLM's logging shows it, beside its own loaders' "Loading weights took".
logger = init_logger(f"vllm.{__name__}")


def register() -> None:
    """Register ``LCTModelLoader`` as vLLM load format ``lct`` (the ``vllm.general_plugins``
    entry point; vLLM calls it once in each of its processes)."""
    register_model_loader(LOAD_FORMAT)(LCTModelLoader)


def loader_options(extra) -> dict:
    """The loader's options from ``model_loader_extra_config`` (None or a dict), defaults
    filled in and each one checked.

    Raises:
        OptionError: an unknown key, or a value out of its range.

    Example:
        >>> loader_options({"prefetch": 4})
        {'prefetch': 4, 'workers': None, 'verify': True}
    """
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise OptionError(f"model_loader_extra_config for load format {LOAD_FORMAT!r} must be a "
                          f"dict, got {type(extra).__name__}",
                          option="model_loader_extra_config")
    unknown = sorted(set(extra) - set(DEFAULTS))
    if unknown:
        raise OptionError(f"model_loader_extra_config: unknown option(s) "
                          f"{', '.join(map(repr, unknown))} for load format {LOAD_FORMAT!r}; "
                          f"it takes {', '.join(DEFAULTS)}", option="model_loader_extra_config")
    opts = {**DEFAULTS, **extra}
    if not isinstance(opts["verify"], bool):
        raise OptionError(f"verify must be true or false, got {opts['verify']!r}",
                          option="verify")
    from lct.loader.source import LoadOptions
    LoadOptions(prefetch=opts["prefetch"], workers=opts["workers"])    # LCT's one check of them
    return opts


class LCTModelLoader(BaseModelLoader):
    """vLLM model loader for LCT artifacts (load format ``lct``)."""

    def __init__(self, load_config):
        super().__init__(load_config)
        self.options = loader_options(load_config.model_loader_extra_config)
        self.stats = None            # the last load's StreamStats

    def _path(self, model_config) -> str:
        from lct.loader.source import resolve
        return resolve(model_config.model, verify=self.options["verify"]).source

    def download_model(self, model_config) -> None:
        """Make the artifact local (a folder is already; ``hf://`` is pulled and checked)."""
        self._path(model_config)

    def load_weights(self, model, model_config) -> None:
        """Stream the artifact's tensors into ``model.load_weights`` and check that every
        parameter was loaded, as vLLM's default loader does.

        Raises:
            ChecksumError, CorruptChunkError: a damaged chunk (the engine stops).
            ArchitectureError: the artifact lacks weights the model has, or holds a head that
                the config ties to the embedding.
        """
        from lct.loader.source import open_source
        path = self._path(model_config)
        t0 = time.perf_counter()
        with open_source(path, verify=self.options["verify"],
                         workers=self.options["workers"]) as art:
            _check_ties(art, model_config)
            weights = self._weights(art, model_config.dtype)
            try:
                loaded = model.load_weights(weights)
            finally:
                weights.close()
        from lct.units import human
        s = self.stats
        logger.info("Loading weights took %.2f seconds (LCT: %d groups, %s read, %s decoded, "
                    "prefetch %d)", time.perf_counter() - t0, s.groups, human(s.bytes_read),
                    human(s.bytes_decoded), self.options["prefetch"])
        if model_config.quantization is None and loaded is not None:
            try:    # vLLM's own check, with its exemptions (quantization scales)
                DefaultModelLoader.track_weights_loading(self, model, loaded, quantized=False)
            except ValueError as e:
                raise ArchitectureError(f"{path}: {e}") from e

    def _weights(self, art, dtype):
        """(checkpoint name, tensor) of every stored tensor, group by group, tied names
        skipped; lossy tables dequantized and cast to ``dtype``."""
        from lct.format.encodings import get_encoding
        tensors, ties = art.manifest.tensors, art.manifest.ties
        with art.stream(prefetch=self.options["prefetch"], dequantize=True) as stream:
            self.stats = stream.stats
            for group in stream:
                for name, t in group.tensors.items():
                    if name in ties:
                        continue
                    if get_encoding(tensors[name].encoding).lossy and t.dtype != dtype:
                        t = t.to(dtype)
                    yield name, t


def _check_ties(art, model_config) -> None:
    """Refuse an artifact that stores a head of its own where the config ties the head to the
    embedding: vLLM's model, built tied, would drop it. (For a safetensors folder vLLM finds
    the ``lm_head`` and unties; an artifact holds no safetensors for it to look at.)"""
    cfg = model_config.hf_config.get_text_config()
    if not getattr(cfg, "tie_word_embeddings", False):
        return
    heads = [t.name for t in art.manifest.tensors.values()
             if t.role == "head" and t.name not in art.manifest.ties]
    if heads:
        raise ArchitectureError(f"{art.path}: config.json ties the word embeddings, but the "
                                f"artifact stores {heads[0]!r} of its own (it differs from the "
                                f"embedding); serve it with "
                                f"hf_overrides={{'tie_word_embeddings': False}}",
                                option="hf_overrides")


__all__ = ["LOAD_FORMAT", "LCTModelLoader", "loader_options", "register"]
