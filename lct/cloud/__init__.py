"""Artifacts in object stores: ``s3://bucket/prefix`` (``lct.cloud.s3``), streamed by range
requests, pulled and pushed. boto3 is imported on first use (``pip install 'lct[s3]'``).

May import: ``lct.hub``, ``lct.io``, ``lct.format`` and the leaves (``lct.errors`` holds the
object-store errors)."""

from lct.cloud.s3 import S3_SCHEME, S3Store, is_s3_uri, open_s3, parse_s3_uri, pull, push

__all__ = ["S3_SCHEME", "S3Store", "is_s3_uri", "open_s3", "parse_s3_uri", "pull", "push"]
