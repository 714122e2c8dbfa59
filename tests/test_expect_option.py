"""Issue 37 item 3: ``expect`` given as anything but a string (a number, the digest as bytes, a
list, a dict) ended lct.load and lct.verify in an AttributeError or a TypeError from inside
the digest check; it is an ``OptionError`` naming ``expect`` and what it must be."""

import pytest

import lct
from lct.errors import OptionError

MUST = "expect must be a string, sha256:<64 hex digits> as lct info prints it, not "


@pytest.fixture(scope="module")
def digest(llama_art):
    with lct.open(llama_art) as art:
        return art.digest


def _bad(digest):
    return {"int": 123, "bytes": digest.encode(), "list": [digest], "dict": {"sha256": digest}}


@pytest.mark.parametrize("kind", ["int", "bytes", "list", "dict"])
def test_load_refuses_an_expect_that_is_not_a_string(llama_art, digest, kind):
    from lct.loader import LayerwiseModel
    bad = _bad(digest)[kind]
    for load in (lambda: lct.load(llama_art, expect=bad),
                 lambda: lct.load(llama_art, expect=bad, device_map={"": "cpu"}),
                 lambda: LayerwiseModel(llama_art, expect=bad)):
        with pytest.raises(OptionError, match=MUST + kind) as e:
            load()
        assert e.value.option == "expect"
    lct.load(llama_art, expect=digest)          # the same digest as a string pins it


@pytest.mark.parametrize("kind", ["int", "bytes", "list", "dict"])
def test_verify_raises_on_an_expect_that_is_not_a_string(llama_art, digest, kind):
    """verify raises the OptionError naming expect (the caller's mistake, as lct.load does),
    where a wrong or malformed digest string is a failed check in its report."""
    with pytest.raises(OptionError, match=MUST + kind) as e:
        lct.verify(llama_art, expect=_bad(digest)[kind])
    assert e.value.option == "expect"
    assert lct.verify(llama_art, expect=digest).ok
    assert not lct.verify(llama_art, expect="sha256:" + "0" * 64).ok
