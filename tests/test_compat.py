"""Issue 22: every private API of another library that LCT calls is wrapped in lct/compat.py;
each test here calls one wrapper on the real library, so that an upgrade that moves one fails
here, naming it. And LCT's own hashes and size parser (hashlib, no huggingface_hub) agree with
huggingface_hub's, and ``lct.open(verify=True)`` works without huggingface_hub."""

import hashlib
import os
import subprocess
import sys
import textwrap

import pytest

from lct import compat
from lct.errors import MissingDependencyError

# -- huggingface_hub's HTTP client ----------------------------------------------------------

@pytest.fixture
def hub_factory():
    """huggingface_hub's client factory put back as it was after the test."""
    import huggingface_hub
    saved = compat.hub_client_factory()
    yield
    huggingface_hub.set_client_factory(saved)


def test_hub_client_factory_is_what_get_session_builds_with(hub_factory):
    import httpx2
    import huggingface_hub
    default = compat.hub_default_client_factory()
    huggingface_hub.set_client_factory(default)
    assert compat.hub_client_factory() is default
    client = huggingface_hub.get_session()
    assert isinstance(client, httpx2.Client)
    assert client.timeout.read is None      # why LCT gives it a timeout

    def mine():
        return httpx2.Client()
    huggingface_hub.set_client_factory(mine)
    assert compat.hub_client_factory() is mine


def test_hub_request_hook_refuses_offline_and_tags_requests(monkeypatch):
    import httpx2
    from huggingface_hub import constants, errors
    request = httpx2.Request("GET", "http://127.0.0.1:9/x")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(errors.OfflineModeIsEnabled):
        compat.hub_request_hook(request)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    compat.hub_request_hook(request)
    assert request.headers.get("X-Amzn-Trace-Id")


def test_set_hub_timeout_gives_the_shared_client_a_timeout_and_keeps_the_hook(hub_factory,
                                                                               monkeypatch):
    import httpx2
    import huggingface_hub
    from huggingface_hub import constants, errors
    huggingface_hub.set_client_factory(compat.hub_default_client_factory())
    assert compat.set_hub_timeout(2.5)
    assert getattr(compat.hub_client_factory(), "lct", False)
    client = huggingface_hub.get_session()
    assert client.timeout.read == 2.5 and client.timeout.connect == 2.5
    (hook,) = client.event_hooks["request"]
    request = httpx2.Request("GET", "http://127.0.0.1:9/x", extensions={"timeout": {
        "connect": None, "read": None, "write": None, "pool": None}})
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hook(request)     # huggingface_hub's timeout=None becomes the limit
    assert request.extensions["timeout"]["read"] == 2.5
    assert request.headers.get("X-Amzn-Trace-Id")       # huggingface_hub's hook ran
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(errors.OfflineModeIsEnabled):
        hook(httpx2.Request("GET", "http://127.0.0.1:9/x"))
    assert compat.set_hub_timeout(1.0)      # LCT's own factory is LCT's to replace
    assert huggingface_hub.get_session().timeout.read == 1.0


def test_set_hub_timeout_leaves_a_programs_own_client_alone(hub_factory):
    import httpx2
    import huggingface_hub

    def mine():
        return httpx2.Client()
    huggingface_hub.set_client_factory(mine)
    assert compat.set_hub_timeout(2.5) is False
    assert compat.hub_client_factory() is mine


# -- torch ----------------------------------------------------------------------------------

def test_dtensor_local_shape_and_offset():
    """Rank 1 of 4 (torch's fake process group, in a process of its own): its rows of a
    row-sharded [8, 6] tensor, all of a replicated one, on a 2 x 2 mesh its block."""
    code = textwrap.dedent("""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from lct.compat import dtensor_local_shape_and_offset as f
        dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
        mesh = init_device_mesh("cpu", (4,))
        print(tuple(map(tuple, f((8, 6), mesh, [Shard(0)]))))
        print(tuple(map(tuple, f((8, 6), mesh, [Replicate()]))))
        mesh2 = init_device_mesh("cpu", (2, 2))
        print(tuple(map(tuple, f((8, 6), mesh2, [Shard(0), Shard(1)]))))
        dist.destroy_process_group()
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split("\n")[:3] == ["((2, 6), (2, 0))", "((8, 6), (0, 0))",
                                          "((4, 3), (0, 3))"]


# -- transformers ---------------------------------------------------------------------------

def test_init_context_builds_on_meta_in_the_dtype():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils.generic import ContextManagers
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    before = torch.get_default_dtype()
    with ContextManagers(compat.init_context(LlamaForCausalLM, torch.bfloat16)):
        model = LlamaForCausalLM(config)
    assert torch.get_default_dtype() == before
    params = list(model.parameters())
    assert params and all(p.is_meta and p.dtype == torch.bfloat16 for p in params)


def test_a_private_api_that_is_gone_is_named():
    with pytest.raises(MissingDependencyError, match=r"_http\.no_such_name.*compat\.py"):
        compat._private("huggingface_hub.utils._http", "no_such_name", "huggingface_hub 2.4.0")
    with pytest.raises(MissingDependencyError, match="get_init_context.*transformers"):
        compat.init_context(type("Model", (), {}), None)


# -- LCT's own hashes and sizes, equal to huggingface_hub's ---------------------------------

BLOBS = [b"", b"Hello, World!", b"\0\0\n", bytes(range(256)) * 1000]


@pytest.mark.parametrize("data", BLOBS, ids=["empty", "hello", "nul", "256k"])
def test_git_blob_id_is_huggingface_hubs_git_hash(data):
    from huggingface_hub.utils.sha import git_hash

    from lct.hashing import git_blob_id
    assert git_blob_id(data) == git_hash(data)


def test_git_blob_id_is_gits():
    from lct.hashing import git_blob_id
    # `git hash-object /dev/null`, and huggingface_hub's documented example
    assert git_blob_id(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"
    assert git_blob_id(b"Hello, World!") == "b45ef6fec89518d314f546fd6c3025367b721684"


@pytest.mark.parametrize("size", [0, 1, (1 << 20) + 7])
def test_sha256_file_is_huggingface_hubs(tmp_path, size):
    from huggingface_hub.utils.sha import sha_fileobj

    from lct.hashing import sha256_file
    path = tmp_path / "f"
    path.write_bytes(os.urandom(size))
    with open(path, "rb") as f:
        assert sha256_file(path) == sha_fileobj(f).hex() == \
            hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("text", ["5GB", "500MB", "2.5GB", "1KB", "0.3KB", "1.5TB", "7mb",
                                  "0.001GB"])
def test_decimal_sizes_parse_as_save_pretrained_parses_them(text):
    try:
        from huggingface_hub.serialization._base import parse_size_to_int
    except ImportError:
        pytest.skip("huggingface_hub no longer has parse_size_to_int (LCT does not use it)")
    from lct.units import parse_size
    assert parse_size(text) == parse_size_to_int(text)


# -- lct.open(verify=True) without huggingface_hub ------------------------------------------

def test_open_and_verify_without_huggingface_hub(gemma_art, tmp_path):
    """huggingface_hub unimportable: opening, verifying every chunk and the side files, and
    catching a changed side file all still work (hashlib does the hashing)."""
    import shutil
    art = tmp_path / "a.lct"
    shutil.copytree(gemma_art, art)
    code = textwrap.dedent(f"""
        import sys
        sys.modules["huggingface_hub"] = None       # import huggingface_hub: ImportError
        import lct
        from lct.errors import ChecksumError
        with lct.open({str(art)!r}, verify=True) as art:
            n = sum(len(art.read_group(g)) for g in art.groups)
            assert not art.check_side_files(), art.check_side_files()
            assert art.read_group(art.groups[0])
        with open({str(art / "config.json")!r}, "a") as f:
            f.write(" ")
        try:
            lct.open({str(art)!r}, verify=True)
        except ChecksumError as e:
            print("changed:", e)
        assert not any(m == "huggingface_hub" or m.startswith("huggingface_hub.")
                       for m in sys.modules if sys.modules[m] is not None)
        print("tensors", n)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "changed:" in res.stdout and "config.json" in res.stdout
    assert int(res.stdout.split("tensors")[1]) > 0
