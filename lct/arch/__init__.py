"""What transformers knows about an architecture, read from the model it builds (never from a
table kept by hand): layer stacks, embeddings, ties, the final norm, routed experts, and the
checkpoint-to-model conversion that ``from_pretrained`` applies (renames, expert fusing).

Example:
    >>> from lct.arch.model import Architecture
    >>> arch = Architecture.from_folder("path/to/mixtral")
    >>> arch.place("model.layers.0.block_sparse_moe.experts.3.w1.weight")
    ('layers.0.experts', 'layer')

May import: ``lct.format`` and the leaves (``lct.errors`` holds ``ArchitectureError``).
Modules: ``hf`` (every call into transformers' semi-public loading code, in one place so that
an upgrade breaks there), ``model`` (``Architecture``: the facts, and ``to_model``, which turns
stored tensors into the built model's parameters).
"""
