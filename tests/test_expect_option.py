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
def test_verify_reports_an_expect_that_is_not_a_string(llama_art, digest, kind):
    """verify reports a digest check that fails, as for a wrong or malformed digest."""
    report = lct.verify(llama_art, expect=_bad(digest)[kind])
    assert not report.ok
    assert [f for f in report.failures if f.startswith(MUST + kind)], \
        report.failures
    assert lct.verify(llama_art, expect=digest).ok
