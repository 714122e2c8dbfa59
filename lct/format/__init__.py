"""The format layer: what an LCT artifact is, byte for byte (docs/FORMAT.md).

The constants of the format, the manifest (parse, validate, seal), the chunk codecs and their
checksums, the NF4 and int8 reference codecs, the chunk layout of a group, the Maximus shard
state file, and the optional compiled inner loops with their numpy fallback.

May import: the leaves (``lct.errors``, ``lct.units``, ``lct.proc``, ``lct._version``) and
numpy, zstandard, xxhash; torch and safetensors only inside the functions that need them.
"""
