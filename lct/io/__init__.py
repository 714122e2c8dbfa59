"""The storage layer: reading and writing artifacts.

Stores (local files; the Hub's range store is ``lct.hub.remote``), the reader (``Artifact``:
chunks, tensors, groups, checks), the prefetching group stream, the writer (atomic publish,
locks), and the summary ``lct info`` prints.

May import: ``lct.format`` and the leaves.
"""
