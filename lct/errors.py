"""The one errors module of LCT.

Every error LCT raises on purpose is an ``LCTError``; each subclass also inherits the builtin it
resembles, so callers can catch either (``except FileNotFoundError`` still works).
"""


class LCTError(Exception):
    """Base class of every LCT error.

    The message describes the problem in the library's words; ``option`` names the parameter it
    is about (``"overwrite"``, ``"blocksize"``), from which the CLI adds its own hint (the flag
    to pass), as huggingface_hub's CLI does over its errors."""

    def __init__(self, *args, option: str | None = None):
        super().__init__(*args)
        self.option = option


class OptionError(LCTError, ValueError):
    """An argument of a library call is of the wrong kind or out of its range (``option``
    names it: a prefetch window below 0, a blocksize that does not divide the width)."""


class EntryNotFoundError(LCTError, KeyError):
    """No tensor or group of that name in the artifact. (Printed as its message, not quoted as
    a ``KeyError``'s key would be.)"""

    __str__ = Exception.__str__


class TokenIdError(LCTError, IndexError):
    """A token id outside the embedding's rows."""


class SourceError(LCTError, ValueError):
    """The conversion source is missing, not a model, or in a refused format."""


class SourceNotFoundError(SourceError, FileNotFoundError):
    """The source path or Hub repository does not exist."""


class ArtifactNotFoundError(LCTError, FileNotFoundError):
    """The artifact directory, its manifest, or one of its data files is missing."""


class ManifestError(LCTError, ValueError):
    """The manifest is malformed, exceeds a cap, or contradicts itself or the data files."""


class UnsupportedVersionError(ManifestError):
    """The artifact's major format version (or a codec/encoding/dtype) is not known to this reader."""


class ChecksumError(LCTError, ValueError):
    """A chunk's stored bytes do not match the checksum recorded in the manifest."""


class ManifestChecksumError(ManifestError, ChecksumError):
    """The manifest's own checksum does not match its bytes (it was changed after writing)."""


class ArtifactClosedError(LCTError, RuntimeError):
    """The artifact was closed while, or before, something read from it (or a writer was used
    after it finished or failed)."""


class CorruptChunkError(LCTError, ValueError):
    """A chunk's bytes cannot be decoded to what the manifest declares."""


class ArchitectureError(LCTError, ValueError):
    """transformers cannot build the model, or the stored tensors do not fill the model it
    builds (a parameter without a tensor, a tensor the model cannot take)."""


class WriteError(LCTError, OSError):
    """A file LCT was writing could not be written: the disk is full, a quota is reached, the
    file system is read-only, or permission is denied. Nothing half-written is left."""


class PolicyError(LCTError, ValueError):
    """A conversion option cannot be applied (bad blocksize, overflowing cast, unknown dtype)."""


class CalibrationUnavailable(LCTError):
    """The default calibration cannot run on this source here (the message says why); the
    quality policy falls back to the text-free proxy (lct.conversion.policy)."""


class MissingDependencyError(LCTError, ImportError):
    """An optional heavy dependency is needed for this operation and is not installed."""


class HubError(LCTError, OSError):
    """A Hub request failed (server error, incomplete download, refused upload)."""


class HubAuthError(HubError, PermissionError):
    """Not logged in, a rejected token, or no access to the repository (401/403, gated)."""


class HubNotFoundError(HubError, FileNotFoundError):
    """No such repository, revision or file on the Hub (or a private one you cannot see)."""


class HubOfflineError(HubError, ConnectionError):
    """The Hub cannot be reached (offline mode, network down) and the cache does not help."""


class HubURIError(LCTError, ValueError):
    """Not a valid ``hf://org/name[@revision]`` address or Hub repo id."""


class ObjectStoreError(LCTError, OSError):
    """An object store (``s3://``, ``gs://``, ``az://``) refused a request, or answered with
    what was not asked."""


class ObjectStoreAuthError(ObjectStoreError, PermissionError):
    """No credentials, or they do not allow the request (access denied)."""


class ObjectStoreNotFoundError(ObjectStoreError, FileNotFoundError):
    """No such bucket or object."""


class ObjectStoreOfflineError(ObjectStoreError, ConnectionError):
    """The object store cannot be reached, or kept failing after the retries."""


class ObjectStoreURIError(LCTError, ValueError):
    """Not a valid ``s3://``, ``gs://`` or ``az://bucket/prefix`` address."""


class MaximusStateError(LCTError, ValueError):
    """A Maximus state file is missing, corrupt, or does not fit the model."""


class PlanError(LCTError, ValueError):
    """The planner cannot plan this model or these options (unknown family, bad option)."""


class ConfigNotFoundError(PlanError, FileNotFoundError):
    """No ``config.json`` where MODEL points (folder, artifact, file or Hub repo)."""


# What a Ctrl-C prints, and the exit status, wherever it lands in a command (lct/__main__.py
# outside the command, lct.cli's group inside it, after the library's cleanup).
INTERRUPTED = "interrupted; nothing was left half-written"
INTERRUPTED_STATUS = 130        # 128 + SIGINT, as a shell reports a process SIGINT ended
