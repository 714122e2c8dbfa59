"""Artifacts in object stores, streamed by range requests, pulled and pushed: ``s3://bucket/
prefix`` (``lct.cloud.s3``, boto3), ``gs://bucket/prefix`` (``lct.cloud.gcs``,
google-cloud-storage) and ``az://container/prefix`` (``lct.cloud.azure``, azure-storage-blob).
One protocol for all of them (``lct.cloud.objects``); each store registers its scheme and
speaks its client, imported on first use (``pip install 'lct[s3]'``, ``'lct[gcs]'``,
``'lct[azure]'``).

May import: ``lct.hub``, ``lct.io``, ``lct.format`` and the leaves (``lct.errors`` holds the
object-store errors)."""

from lct.cloud import azure, gcs, s3  # noqa: F401 - each registers its scheme
from lct.cloud.objects import (
    Backend,
    ObjectStore,
    ensure_new_prefix,
    fetch_small,
    is_cloud_uri,
    open_cloud,
    parse_uri,
    pull,
    push,
)


def local_or_open(path):
    """What a command that reads an artifact opens, from its address: a folder as it is, an
    ``hf://`` address pulled into the Hugging Face cache (``lct.hub.local_artifact``), both as
    a path; an object store address as an open, streaming ``Artifact`` (the caller closes
    it)."""
    if is_cloud_uri(str(path)):
        return open_cloud(str(path))
    from lct.hub import local_artifact
    return local_artifact(path)


__all__ = ["Backend", "ObjectStore", "ensure_new_prefix", "fetch_small", "is_cloud_uri",
           "local_or_open", "open_cloud", "parse_uri", "pull", "push"]
