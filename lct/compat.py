"""Every private API of another library that LCT calls, one thin wrapper each, so that an
upgrade that moves one breaks here (and in tests/test_compat.py, which calls each wrapper on the
real library) rather than somewhere in the Hub or loading code.

Each wrapper names what it wraps and the versions it was checked against. The libraries are
imported inside the wrappers: importing this module costs nothing. A name that a newer version
no longer has is a ``MissingDependencyError`` naming it.

Public names (``huggingface_hub.HfApi``, ``get_session``, ``hf_raise_for_status``,
``huggingface_hub.errors``, accelerate's ``infer_auto_device_map``) are called where they are
used. transformers' semi-public loading API (``conversion_mapping``, ``core_model_loading``,
the model hooks ``_from_config``, ``_init_weights``, ``_get_dtype_plan``) has its own home,
``lct.arch.hf``, which says what LCT asks of transformers; its one call with private positional
flags, ``get_init_context``, is here.

A leaf: the hub and arch layers both need it.
"""

from __future__ import annotations

import logging

from lct.errors import MissingDependencyError

log = logging.getLogger(__name__)


def _private(module: str, name: str, checked: str):
    """``module.name``, or a ``MissingDependencyError`` saying that this version lacks it."""
    import importlib
    mod = importlib.import_module(module)
    try:
        return getattr(mod, name)
    except AttributeError as e:
        top = importlib.import_module(module.split(".")[0])
        raise MissingDependencyError(
            f"{module}.{name}, a private API LCT uses, is gone in {top.__name__} "
            f"{getattr(top, '__version__', '?')} (lct/compat.py was checked against {checked}); "
            f"install that version, or update lct/compat.py") from e


# -- huggingface_hub: its shared HTTP client ----------------------------------------------

_HUB = "huggingface_hub 2.4.0"


def hub_client_factory():
    """The factory huggingface_hub builds its one shared HTTP client with (``get_session``).

    Wraps the private ``huggingface_hub.utils._http._GLOBAL_CLIENT_FACTORY`` (there is a public
    setter, ``set_client_factory``, and no getter). Checked against huggingface_hub 2.4.0.
    """
    return _private("huggingface_hub.utils._http", "_GLOBAL_CLIENT_FACTORY", _HUB)


def hub_default_client_factory():
    """huggingface_hub's own client factory (no timeout: ``timeout=None``).

    Wraps the private ``huggingface_hub.utils._http.default_client_factory``. Checked against
    huggingface_hub 2.4.0.
    """
    return _private("huggingface_hub.utils._http", "default_client_factory", _HUB)


def hub_request_hook(request) -> None:
    """What huggingface_hub does to every request its own client sends: refuse it under
    ``HF_HUB_OFFLINE`` (``OfflineModeIsEnabled``), add a request id and the download counter
    header, log it at debug level. A client of LCT's must keep doing that.

    Wraps the private ``huggingface_hub.utils._http.hf_request_event_hook``. Checked against
    huggingface_hub 2.4.0.
    """
    _private("huggingface_hub.utils._http", "hf_request_event_hook", _HUB)(request)


def set_hub_timeout(seconds: float) -> bool:
    """Replace huggingface_hub's HTTP client factory, for the whole process, by one whose
    clients end a request after ``seconds`` without a byte (connect: at most 10 s), and keep
    its request hook (``hub_request_hook``). huggingface_hub's own waits for ever.

    Process-wide on purpose: huggingface_hub shares one client between every call and thread
    (``snapshot_download``'s workers, a streamed artifact's range reads, the program's own
    calls), and ``set_client_factory`` closes the client in use; setting and restoring it
    around each LCT call would close a client another thread is reading with.

    Returns:
        True when LCT's factory is in place; False, changing nothing, when the program installed
        a factory of its own (not LCT's to change) or this huggingface_hub lacks the private
        names above (logged; tests/test_compat.py fails on that).

    Uses the public ``huggingface_hub.set_client_factory`` and the private names of
    ``hub_client_factory``, ``hub_default_client_factory`` and ``hub_request_hook``. Checked
    against huggingface_hub 2.4.0 (httpx2 clients).
    """
    import httpx2
    from huggingface_hub import set_client_factory
    try:
        current, default = hub_client_factory(), hub_default_client_factory()
        hook = _private("huggingface_hub.utils._http", "hf_request_event_hook", _HUB)
    except MissingDependencyError as e:
        log.warning("%s; Hub calls keep huggingface_hub's HTTP client (no timeout)", e)
        return False
    if current is not default and not getattr(current, "lct", False):
        return False
    limit = httpx2.Timeout(seconds, connect=min(seconds, 10.0))

    def with_limit(request):
        hook(request)
        # huggingface_hub passes timeout=None on its API calls, which turns off the client's
        # default: a request that would wait for ever gets the limit here instead.
        given = request.extensions.get("timeout") or {}
        if all(v is None for v in given.values()):
            request.extensions["timeout"] = limit.as_dict()

    def client():
        return httpx2.Client(event_hooks={"request": [with_limit]}, follow_redirects=True,
                             timeout=limit)
    client.lct = True
    set_client_factory(client)
    return True


# -- torch --------------------------------------------------------------------------------

def dtensor_local_shape_and_offset(shape, mesh, placements) -> tuple:
    """``(local shape, global offset)`` of this rank's part of a DTensor of global ``shape``
    placed by ``placements`` on ``mesh``, without communication.

    Wraps the private ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``.
    Checked against torch 2.13.0.
    """
    fn = _private("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset",
                  "torch 2.13.0")
    return fn(shape, mesh, placements)


# -- transformers -------------------------------------------------------------------------

def init_context(cls, dtype) -> list:
    """The context managers ``from_pretrained`` builds model class ``cls`` under: ``dtype`` as
    the default dtype, the meta device, ties deferred until the weights are in.

    Wraps ``PreTrainedModel.get_init_context(dtype, is_quantized, _is_ds_init_called,
    allow_all_kernels)``, a classmethod with private positional flags (here all False: not
    quantized, no DeepSpeed init, no Hub kernels). Checked against transformers 5.24.0.
    """
    try:
        get = cls.get_init_context
    except AttributeError as e:
        import transformers
        raise MissingDependencyError(
            f"{cls.__name__}.get_init_context, a private API LCT uses, is gone in transformers "
            f"{transformers.__version__} (lct/compat.py was checked against transformers "
            f"5.24.0); install that version, or update lct/compat.py") from e
    return list(get(dtype, False, False, False))
