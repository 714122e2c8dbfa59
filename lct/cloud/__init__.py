"""Artifacts in object stores: ``s3://bucket/prefix`` (``lct.cloud.s3``), streamed by range
requests, pulled and pushed. boto3 is imported on first use (``pip install 'lct[s3]'``).

May import: ``lct.hub``, ``lct.io``, ``lct.format`` and the leaves (``lct.errors`` holds the
object-store errors)."""

from lct.cloud.s3 import (
    S3_SCHEME,
    S3Store,
    is_s3_uri,
    open_s3,
    parse_s3_uri,
    pull,
    push,
)


def local_or_open(path):
    """What a command that reads an artifact opens, from its address: a folder as it is, an
    ``hf://`` address pulled into the Hugging Face cache (``lct.hub.local_artifact``), both as
    a path; an ``s3://`` address as an open, streaming ``Artifact`` (the caller closes it)."""
    if is_s3_uri(str(path)):
        return open_s3(str(path))
    from lct.hub import local_artifact
    return local_artifact(path)


__all__ = ["S3_SCHEME", "S3Store", "is_s3_uri", "local_or_open", "open_s3", "parse_s3_uri",
           "pull", "push"]
