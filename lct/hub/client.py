"""LCT's use of huggingface_hub: importing it, the HTTP timeout every Hub call gets, and the
mapping of its errors to one-line LCT errors that say what to do."""

from __future__ import annotations

from lct.errors import (
    HubAuthError,
    HubError,
    HubNotFoundError,
    HubOfflineError,
    HubURIError,
    LCTError,
    MissingDependencyError,
)
from lct.hub.address import where

# Seconds without a byte from the Hub before a call through huggingface_hub fails
# (LCT_HUB_TIMEOUT overrides; huggingface_hub itself waits for ever); S3's default too.
HUB_TIMEOUT = 60.0


def _hub():
    try:
        import huggingface_hub
        import huggingface_hub.constants  # noqa: F401  (a submodule: not an attribute until imported)
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise MissingDependencyError("huggingface_hub is required for the Hub: "
                                     "pip install huggingface_hub") from e
    if _TIMEOUT[0] is None:
        use_timeout(None)
    return huggingface_hub


_TIMEOUT: list = [None]   # seconds LCT gave huggingface_hub's HTTP client (None: not yet)


def hub_timeout() -> float:
    """Seconds without a byte from the Hub before a call ends: ``LCT_HUB_TIMEOUT`` or
    ``HUB_TIMEOUT``."""
    import os
    try:
        return float(os.environ.get("LCT_HUB_TIMEOUT", HUB_TIMEOUT))
    except ValueError:
        return HUB_TIMEOUT


def use_timeout(seconds: float | None = None) -> None:
    """Give huggingface_hub's HTTP client (every Hub call LCT makes goes through it) a timeout:
    ``seconds`` without a byte from the Hub (default: ``LCT_HUB_TIMEOUT`` or
    ``HUB_TIMEOUT``) ends the call in an error instead of a hang; its own default waits for
    ever. Left alone when the program installed a client factory of its own (process-wide:
    ``lct.compat.set_hub_timeout`` says why)."""
    from lct.compat import set_hub_timeout
    seconds = hub_timeout() if seconds is None else seconds
    # 0.0: the program's own client, not ours to change
    _TIMEOUT[0] = seconds if set_hub_timeout(seconds) else 0.0


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _endpoint() -> str:
    try:
        return _hub().constants.ENDPOINT
    except Exception:  # noqa: BLE001
        return "the Hub"


def hub_error(e: BaseException, repo_id: str, revision: str | None = None,
              action: str = "download") -> LCTError:
    """The ``LCTError`` (with a one-line hint) for an exception raised by ``huggingface_hub``.

    ``action`` (``"download"`` or ``"push"``) picks the hint. An ``LCTError`` is returned as is;
    anything unknown becomes a ``HubError`` carrying the original message's first line.
    """
    if isinstance(e, LCTError):
        return e
    import httpx2
    from huggingface_hub import errors as herr
    at = where(repo_id, revision)
    login = "log in with `hf auth login` or set HF_TOKEN"
    chain = list(_chain(e))

    def find(*types):
        return next((x for x in chain if isinstance(x, types)), None)

    if find(herr.OfflineModeIsEnabled) is not None:
        if action == "push":
            return HubOfflineError(f"{at}: HF_HUB_OFFLINE is set, and a push needs the Hub; "
                                   f"unset HF_HUB_OFFLINE to push")
        return HubOfflineError(f"{at}: offline (HF_HUB_OFFLINE is set) and not in the local "
                               f"Hugging Face cache; unset HF_HUB_OFFLINE, or pull it once while "
                               f"online")
    if isinstance(e, herr.LocalTokenNotFoundError):
        return HubAuthError(f"{at}: not logged in; {login}")
    http = find(herr.HfHubHTTPError)
    if isinstance(http, herr.RevisionNotFoundError):
        return HubNotFoundError(f"{repo_id}: no revision {revision!r} in this repo "
                                f"(a branch, tag or commit)")
    if isinstance(http, herr.GatedRepoError):
        return HubAuthError(f"{at}: gated repo; accept its conditions on the Hub, then {login}")
    if isinstance(http, herr.RemoteEntryNotFoundError):
        return HubNotFoundError(f"{at}: a file is missing from the repo ({_first_line(http)})")
    status = getattr(getattr(http, "response", None), "status_code", None)
    if http is not None and status == 401 and not isinstance(http, herr.RepositoryNotFoundError):
        return HubAuthError(f"{at}: the Hub rejected the token (401): HF_TOKEN or the stored "
                            f"login is invalid or expired; {login}")
    if isinstance(http, herr.RepositoryNotFoundError):
        if action == "push":
            return HubAuthError(f"{at}: cannot write to this repo: it does not exist and could "
                                f"not be created, or you have no access; {login} with a "
                                f"write token")
        return HubNotFoundError(f"{at}: no such repo on {_endpoint()}, or it is private and "
                                f"you are not logged in ({login})")
    if http is not None and status == 403:
        what = "write access to this repo or namespace" if action == "push" else "access"
        return HubAuthError(f"{at}: no access (403): your token does not grant {what}; "
                            f"check its permissions or {login}")
    if http is not None and status == 404:
        return HubNotFoundError(f"{at}: not found on {_endpoint()} ({_first_line(http)})")
    if http is not None:
        return HubError(f"{at}: the Hub answered {status}: {_first_line(http)}")
    stall = find(httpx2.TimeoutException)
    if stall is not None and not isinstance(stall, httpx2.ConnectTimeout):
        waited = f" for {_TIMEOUT[0]:g} s" if _TIMEOUT[0] else ""   # None/0: not LCT's client
        return HubOfflineError(f"{at}: {_endpoint()} stopped answering{waited} "
                               f"({type(stall).__name__}); try again, or set LCT_HUB_TIMEOUT to "
                               f"wait longer")
    net = find(httpx2.ConnectError, httpx2.TimeoutException, httpx2.NetworkError,
               ConnectionError)
    if net is not None:
        cached = " and it is not in the local cache" if action == "download" else ""
        return HubOfflineError(f"{at}: cannot reach {_endpoint()} ({type(net).__name__}: "
                               f"{_first_line(net)}){cached}; check the network, or set "
                               f"HF_HUB_OFFLINE=1 to use only the cache")
    if isinstance(e, herr.LocalEntryNotFoundError):
        return HubOfflineError(f"{at}: not in the local Hugging Face cache and the Hub could "
                               f"not be reached")
    if isinstance(e, (herr.HFValidationError, ValueError)) and "repo" in str(e).lower() \
            and "id" in str(e).lower():
        return HubURIError(f"{repo_id}: not a valid Hub repo id ({_first_line(e)})")
    if isinstance(e, OSError) and e.errno is not None:
        import os
        on = f" {e.filename}" if getattr(e, "filename", None) else ""
        return HubError(f"{at}: {action} failed: a local file{on}: {os.strerror(e.errno)}")
    return HubError(f"{at}: {action} failed: {type(e).__name__}: {_first_line(e)}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def hub_fetch(fetch, repo_id: str, revision: str | None, *, not_found, error, offline,
              maybe_folder: bool = True):
    """Run ``fetch()`` (a huggingface_hub download for a pipeline: a source checkpoint, a
    config) and raise its failure as the caller's error class, with ``hub_error``'s message:
    ``not_found`` for a missing repo, revision or file, ``offline`` when the Hub cannot be
    reached and the cache does not help, ``error`` for anything else. ``maybe_folder``: the
    user gave ``repo_id`` where a local folder is also taken (not as ``hf://``), so a missing
    or unreachable repo's message says that no such folder exists either (``models/lama`` is
    as likely a mistyped folder as a repo)."""
    _hub()          # the HTTP timeout every Hub call gets (downloads for pipelines too)
    try:
        return fetch()
    except Exception as e:  # noqa: BLE001 - every Hub failure becomes one clear line
        mapped = hub_error(e, repo_id, revision, action="download")
        text = str(mapped)
        if maybe_folder and isinstance(mapped, (HubNotFoundError, HubOfflineError)):
            text += f" (and there is no folder {repo_id!r} here)"
        if isinstance(mapped, HubNotFoundError):
            raise not_found(text) from e
        if isinstance(mapped, HubOfflineError):
            raise offline(text) from e
        raise error(text) from e
