"""Ctrl-C at any moment of an ``lct`` process (issue 22.8, F5 and F6): one line, exit status 130,
no traceback, nothing left behind, and at once; a SIGINT after the result keeps it a success.

Each case runs the real entry point (``python -m lct``, the console script's function) in a
subprocess; the source that is still being hashed when the signal comes is a sparse file of a
few GB of zeros, which takes no disk space."""

import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time

import pytest

from lct.errors import INTERRUPTED, INTERRUPTED_STATUS

LCT = [sys.executable, "-m", "lct"]


def _env(bars: bool = False) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("LCT_DEBUG", None)
    if bars:                    # the stage lines ("convert: encoding ...") come with the bars
        env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
        env.pop("TQDM_DISABLE", None)
    return env


@pytest.fixture(scope="module")
def sparse_src(tmp_path_factory):
    """A Llama of 16 layers at 4096 wide, 6.5 GB of bf16 zeros in one sparse safetensors file:
    hashing it takes seconds, storing it nothing."""
    out = tmp_path_factory.mktemp("sparse") / "model"
    out.mkdir()
    H, I, V, L = 4096, 11008, 256, 16
    (out / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=H,
        intermediate_size=I, num_hidden_layers=L, num_attention_heads=H // 128,
        num_key_value_heads=H // 128, head_dim=128, vocab_size=V, tie_word_embeddings=False,
        max_position_embeddings=64, rms_norm_eps=1e-6, torch_dtype="bfloat16")))
    shapes = {"model.embed_tokens.weight": [V, H], "model.norm.weight": [H],
              "lm_head.weight": [V, H]}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + f"self_attn.{x}_proj.weight": [H, H] for x in "qkvo"})
        shapes.update({p + "mlp.gate_proj.weight": [I, H], p + "mlp.up_proj.weight": [I, H],
                       p + "mlp.down_proj.weight": [H, I], p + "input_layernorm.weight": [H],
                       p + "post_attention_layernorm.weight": [H]})
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path = out / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    if path.stat().st_blocks * 512 > 1 << 20:
        path.unlink()
        pytest.skip(f"{out.parent}: the file system does not keep sparse files")
    return out


def _stderr_lines(text: str) -> list:
    """stderr's lines without the progress bar's redraws."""
    return [ln for ln in text.replace("\r", "\n").splitlines()
            if ln.strip() and not ln.startswith("convert:")]


def test_sigint_while_the_source_is_hashed_exits_at_once(sparse_src, tmp_path):
    """F5: the process printed the line at once, then waited for the hashing thread to read
    the whole source (8 s on 8 GB)."""
    out_dir = tmp_path / "o"
    out_dir.mkdir()
    p = subprocess.Popen([*LCT, "convert", str(sparse_src), "-o", str(out_dir / "a.lct")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env(bars=True))
    try:
        seen = []
        for line in p.stderr:             # the stage lines end with "\n", the bar's with "\r"
            seen.append(line)
            if "convert: encoding" in line:
                break
        else:
            pytest.fail(f"the conversion ended before encoding: {''.join(seen)}")
        sent = time.monotonic()
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        p.kill()
        p.wait()
    assert p.returncode == INTERRUPTED_STATUS, err
    assert "Traceback" not in err and _stderr_lines(err) == [INTERRUPTED], err
    assert took < 5, f"exited {took:.1f} s after SIGINT"  # a loaded CI machine: margin
    assert list(out_dir.iterdir()) == []         # no artifact, no staging folder


def test_an_error_part_way_stops_the_hashing(sparse_src, tmp_path, monkeypatch):
    """F5, in the library: a conversion that fails part-way leaves no thread reading the
    source."""
    import lct
    from lct.conversion import converter

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(converter, "_write_groups", broken)
    with pytest.raises(OSError, match="No space left"):
        lct.convert(str(sparse_src), tmp_path / "a.lct")
    deadline = time.monotonic() + 1
    while any(t.name.startswith("lct-hash") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the source is still being hashed"
        time.sleep(0.01)
    assert not (tmp_path / "a.lct").exists()


def test_a_set_stop_event_ends_the_hash_and_only_inside_its_block(tmp_path):
    import hashlib
    from concurrent.futures import CancelledError

    from lct.hashing import sha256_file, stop_when
    path = tmp_path / "f"
    data = os.urandom(3 << 20)
    path.write_bytes(data)
    stop = threading.Event()
    with stop_when(stop):
        assert sha256_file(path) == hashlib.sha256(data).hexdigest()
        stop.set()
        with pytest.raises(CancelledError, match="hashing stopped"):
            sha256_file(path)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()   # the event is not read


def test_sigint_after_the_result_keeps_the_success(gemma_art):
    """F6 (ii, iii): a SIGINT just after the result was printed hit the interpreter's teardown:
    "Exception ignored in atexit callback ... KeyboardInterrupt" with exit status 0, or a
    silent death by SIGINT."""
    ref = subprocess.run([*LCT, "info", str(gemma_art)], capture_output=True, text=True,
                         env=_env(), timeout=60)
    assert ref.returncode == 0, ref.stderr
    last = ref.stdout.splitlines()[-1]
    for _ in range(3):
        p = subprocess.Popen([*LCT, "info", str(gemma_art)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=_env())
        try:
            for line in p.stdout:
                if line.rstrip("\n") == last:
                    p.send_signal(signal.SIGINT)
                    break
            _, err = p.communicate(timeout=30)
        finally:
            p.kill()
            p.wait()
        assert p.returncode in (0, INTERRUPTED_STATUS), (p.returncode, err)
        assert "Traceback" not in err and "Exception ignored" not in err, err
        assert err in ("", INTERRUPTED + "\n"), err


# `python -m lct` with the import of click held (and announced on stdout): a SIGINT then lands
# in the start-up, before the click group, every time.
_HELD_START = r"""
import runpy, sys, time
class HoldClick:
    def find_spec(self, name, path=None, target=None):
        if name == "click":
            print("importing click", flush=True)
            time.sleep(20)
        return None
sys.meta_path.insert(0, HoldClick())
runpy.run_module("lct", run_name="__main__", alter_sys=True)
"""


def test_sigint_during_start_up(gemma_art):
    """F6 (i): a SIGINT while the CLI's modules were imported gave a KeyboardInterrupt
    traceback and death by SIGINT."""
    p = subprocess.Popen([sys.executable, "-c", _HELD_START, "info", str(gemma_art)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        assert p.stdout.readline() == "importing click\n"
        sent = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        p.kill()
        p.wait()
    assert p.returncode == INTERRUPTED_STATUS and err == INTERRUPTED + "\n", (p.returncode, err)
    assert out == "" and time.monotonic() - sent < 5


def test_the_entry_point_keeps_the_exit_status_and_the_one_line(tmp_path):
    """The entry ends the process with os._exit: the status and the error line still come."""
    res = subprocess.run([*LCT, "info", str(tmp_path / "missing.lct")], capture_output=True,
                         text=True, env=_env(), timeout=60)
    assert res.returncode == 1 and res.stdout == "", res
    assert len(res.stderr.splitlines()) == 1 and res.stderr.startswith("error: "), res.stderr


def test_the_console_script_is_the_same_entry():
    from pathlib import Path
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["lct"] == "lct.__main__:main"
