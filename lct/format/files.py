"""Writing a safetensors file the way every other LCT output file is written: readable by all
(0644; safetensors creates 0600), and a failed write an ``OSError`` with its errno (safetensors
raises its own ``SafetensorError`` carrying only the text "I/O error: ... (os error 28)"), so
that the callers' one-line write errors (``lct.io.writer.write_error``) apply to it too."""

from __future__ import annotations

import errno
import os
import re

_OS_ERROR = re.compile(r"os error (\d+)")


def save_safetensors(tensors: dict, path, metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file(tensors, path, metadata)``, then mode 0644.

    Raises:
        OSError: the write failed (``errno`` as the system gave it, ``filename`` ``path``).
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        m = _OS_ERROR.search(str(e))
        if m is None:
            raise
        code = int(m.group(1))
        raise OSError(code, os.strerror(code) if code in errno.errorcode else str(e),
                      str(path)) from e
    os.chmod(path, 0o644)
