"""The conversion pipeline: a Hugging Face checkpoint to an artifact and back.

Sources (local folders, Hub ids), the name mapping to groups and roles, token frequencies,
the converter, the auto policy and its quality measurement, the verifier and the exporter.

May import: ``lct.loader`` (quality measurement loads models), ``lct.hub``, ``lct.kernels``,
``lct.io``, ``lct.format`` and the leaves.
"""
