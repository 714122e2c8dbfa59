"""Publishing and fetching LCT artifacts on the Hugging Face Hub.

``push`` verifies an artifact, writes a model card and uploads everything in one commit (large
files through LFS or Xet, as the Hub chooses); ``pull`` downloads a snapshot through the Hugging
Face cache (resumable, ``HF_HUB_OFFLINE`` respected) and verifies every checksum before handing
out its path; ``parse_hf_uri`` reads ``hf://org/name@revision``. Streaming chunks straight from
the Hub, without downloading whole files, is ``lct.hub.remote.open_remote``.

Authentication is ``HF_TOKEN`` or the stored login (``hf auth login``), or an explicit
``token=``. Hub failures become one-line ``HubError`` subclasses that say what to do.

Example:
    >>> lct.hub.push("gemma-2b.lct", "me/gemma-2b-lct")
    >>> path = lct.hub.pull("me/gemma-2b-lct")
    >>> model = lct.load("hf://me/gemma-2b-lct@main", prefetch=2)

May import: ``lct.io``, ``lct.format`` and the leaves (``lct.errors`` holds the Hub errors).
Modules: ``address`` (hf:// and repo ids), ``client`` (huggingface_hub, timeouts, error
mapping), ``card`` (model card), ``push``, ``pull``, ``remote`` (range reads).
"""

from lct.errors import HubAuthError, HubError, HubNotFoundError, HubOfflineError, HubURIError
from lct.hub.address import HF_SCHEME, is_hf_uri, is_repo_id, parse_hf_uri, split_address
from lct.hub.card import model_card
from lct.hub.client import _hub, hub_error, use_timeout
from lct.hub.pull import PullResult, local_artifact, pull, pull_detailed
from lct.hub.push import PushResult, push

__all__ = ["HF_SCHEME", "HubAuthError", "HubError", "HubNotFoundError", "HubOfflineError",
           "HubURIError", "PullResult", "PushResult", "hub_error", "is_hf_uri", "is_repo_id",
           "local_artifact", "model_card", "parse_hf_uri", "pull",
           "pull_detailed", "push", "split_address", "use_timeout", "_hub"]
