"""The conversion pipeline: a Hugging Face checkpoint to an artifact and back.

Sources (local folders, Hub ids), token frequencies, the converter (groups and roles come from
``lct.arch``), the auto policy and its quality measurement, the verifier and the exporter.

May import: ``lct.loader`` (quality measurement loads models), ``lct.arch``, ``lct.hub``,
``lct.kernels``, ``lct.io``, ``lct.format`` and the leaves.
"""
