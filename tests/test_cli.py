"""The CLI: every command works through CliRunner, errors are one line with a non-zero exit."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from lct.cli.main import COMMANDS, cli


def _damaged_copy(art, dst):
    """A copy of ``art`` with one byte in the middle of its data file flipped."""
    shutil.copytree(art, dst)
    data = next(dst.glob("*.lct"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    return dst

def _command(name):
    import click
    return cli.get_command(click.Context(cli), name)


def _flat(text: str) -> str:
    """Help text with click's wrapping undone (line breaks, indents, breaks after hyphens)."""
    return re.sub(r"-\s+", "-", " ".join(text.split()))


def _subcommands():
    """``[(name, sub)]``: every command, and each subcommand of a group as ``"group sub"``."""
    import click
    out = []
    for name in sorted(COMMANDS):
        cmd = _command(name)
        if isinstance(cmd, click.Group):
            out += [f"{name} {sub}" for sub in sorted(cmd.commands)]
        else:
            out.append(name)
    return out


@pytest.mark.parametrize("name", _subcommands())
def test_help_on_every_command(run, name):
    """``lct --help`` lists each command with its summary, and ``lct NAME --help`` shows the
    usage with its arguments, its description and every option with its help text; a group's
    (``lct cache``) lists its subcommands, each of which is held to the same."""
    import click
    group, _, sub = name.partition(" ")
    cmd = _command(group)
    assert cmd is not None and cmd.name == group
    top = CliRunner().invoke(cli, ["--help"], terminal_width=200)
    assert top.exit_code == 0
    summary = cmd.get_short_help_str(limit=150)
    assert summary and re.search(rf"^  {group} +{re.escape(summary)}$", top.output, re.M), \
        top.output
    if sub:
        res = run(group, "--help")
        assert res.exit_code == 0 and re.search(rf"^  {sub} ", res.output, re.M), res.output
        cmd = cmd.commands[sub]
    res = run(*name.split(), "--help")
    assert res.exit_code == 0 and "Traceback" not in res.output
    args = " ".join(p.human_readable_name for p in cmd.params if isinstance(p, click.Argument))
    assert re.search(rf"^Usage: \S+ {name} \[OPTIONS\]{' ' + re.escape(args) if args else ''}$",
                     res.output, re.M), res.output
    text = _flat(res.output)
    assert _flat(cmd.help.split("\n\n")[0]) in text          # the description's first paragraph
    options = [p for p in cmd.params if isinstance(p, click.Option) and not p.hidden]
    assert options, name
    for opt in options:
        for flag in opt.opts + opt.secondary_opts:
            assert re.search(rf"(^|[\s,/]){re.escape(flag)}([\s,=/]|$)", res.output, re.M), \
                (name, flag)
        if opt.help:
            assert _flat(opt.help)[:60] in text, (name, opt.opts)
    assert run(*name.split(), "-h").output == res.output


def _tensors(path):
    from safetensors.torch import load_file
    return load_file(Path(path) / "model.safetensors")


def _one_line_error(res, fragment):
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    assert res.output.startswith("error: ") and res.output.count("\n") == 1, res.output
    assert fragment in res.output, res.output


def _real_convert(run, tmp_path, request):
    import lct
    src = request.getfixturevalue("llama_src")
    out = tmp_path / "m.lct"
    res = run("convert", src, "-o", out, "--nf4", "none")
    assert res.exit_code == 0, res.output
    assert f"wrote {out}" in res.output
    ref = _tensors(src)
    with lct.open(out) as art:
        assert sorted(art.tensor_names) == sorted(ref)
        for name, t in ref.items():
            assert torch.equal(art.read_tensor(name), t), name


def _real_info(run, tmp_path, request):
    import lct
    art_path = request.getfixturevalue("llama_art")
    res = run("info", art_path, "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    with lct.open(art_path) as art:
        assert [g["group"] for g in summary["groups"]] == art.groups
        assert [g["tensors"] for g in summary["groups"]] == \
            [len(art.manifest.group_tensors(g)) for g in art.groups]
        assert summary["tensors"] == len(art.manifest.tensors)
        assert summary["stored_bytes"] == sum(c.stored_size for c in art.manifest.chunks)
        assert summary["decoded_bytes"] == sum(c.decoded_size for c in art.manifest.chunks)
    text = run("info", art_path).output
    assert all(g["group"] in text for g in summary["groups"])


def _real_verify(run, tmp_path, request):
    import lct
    art_path = request.getfixturevalue("llama_art")
    src = request.getfixturevalue("llama_src")
    res = run("verify", art_path, "--against", src, "--json")
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    with lct.open(art_path) as art:
        n_chunks = len(art.manifest.chunks)
        lossy = {n for n in art.manifest.tensors if art.tensor_info(n).encoding != "plain"}
        lossless = set(_tensors(src)) - lossy - set(art.manifest.ties)
    assert lossy and lossless
    assert report["ok"] is True and report["failures"] == []
    assert report["chunks_checked"] == n_chunks
    assert report["lossless_tensors"] == report["lossless_identical"] == len(lossless)
    assert {t["name"] for t in report["lossy_tensors"]} == lossy
    bad = _damaged_copy(art_path, tmp_path / "bad.lct")
    res = run("verify", bad)
    assert res.exit_code == 1 and "FAIL" in res.output and "Traceback" not in res.output


def _real_export(run, tmp_path, request):
    import lct
    art_path = request.getfixturevalue("llama_art")
    src = _tensors(request.getfixturevalue("llama_src"))
    res = run("export", art_path, tmp_path / "hf")
    assert res.exit_code == 0, res.output
    exported = _tensors(tmp_path / "hf")
    assert sorted(exported) == sorted(src)
    with lct.open(art_path) as art:
        for name, t in exported.items():
            if art.tensor_info(name).encoding == "plain":
                assert torch.equal(t, src[name]), name
            else:   # NF4/int8: the stored codes dequantized
                assert torch.equal(t, art.read_tensor(name)), name
    assert (tmp_path / "hf" / "config.json").is_file()


def _real_load(run, tmp_path, request):
    import lct
    art_path = request.getfixturevalue("llama_art")
    res = run("load", art_path, "--ids", "1,5,9", "--max-new-tokens", "3", "--prefetch", "1",
              "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    ids = torch.tensor([[1, 5, 9]])
    want = lct.load(art_path).generate(ids, max_new_tokens=3, do_sample=False)[0, 3:]
    assert out["new_tokens"] == len(want) and out["token_ids"] == want.tolist()
    assert out["text"] == " ".join(str(int(i)) for i in want)
    with lct.open(art_path) as art:
        assert out["breakdown"]["groups"] == len(art.groups)
    assert out["breakdown"]["max_in_flight"] == 1


def _offline(monkeypatch, tmp_path):
    """Offline as HF_HUB_OFFLINE=1 makes it (conftest sets it), with an empty cache."""
    import huggingface_hub.constants as hc
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))


def _real_push(run, tmp_path, request):
    """Pushing for real is tested against the loopback Hub (test_hub.py); offline, every
    refusal is one line and exit 1."""
    _offline(request.getfixturevalue("monkeypatch"), tmp_path)
    art_path = request.getfixturevalue("llama_art")
    _one_line_error(run("push", tmp_path / "missing.lct", "org/name"),
                    "no such artifact directory")
    _one_line_error(run("push", art_path, "not a repo"), "not a Hub model address")
    _one_line_error(run("push", art_path, "org/name"), "HF_HUB_OFFLINE is set")


def _real_pull(run, tmp_path, request):
    """Pulling for real is tested against the loopback Hub (test_hub.py); offline with an empty
    cache, a bad address and a repo that is not cached are one-line errors, exit 1."""
    _offline(request.getfixturevalue("monkeypatch"), tmp_path)
    _one_line_error(run("pull", "not a repo"), "not a Hub model address")
    _one_line_error(run("pull", "hf:///bad"), "not a Hub model address")
    _one_line_error(run("pull", "lct-tests/no-such-model", "--local-dir", tmp_path / "out"),
                    "HF_HUB_OFFLINE is set")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def _real_plan(run, tmp_path, request):
    art_path = request.getfixturevalue("llama_art")
    src = request.getfixturevalue("llama_src")
    res = run("plan", art_path, "--json", "--memory", "16GiB")
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    assert plan["params"] == sum(t.numel() for t in _tensors(src).values())
    assert plan["params"] == sum(p["params"] for p in plan["parts"])
    info = json.loads(run("info", art_path, "--json").output)
    assert plan["stored"] == info["stored_bytes"] and plan["decoded"] == info["decoded_bytes"]
    assert plan["fits"] is True and plan["memory"] == 16 << 30
    assert "fits in 17.18 GB" in run("plan", art_path, "--memory", "16GiB").output
    res = run("plan", art_path, "--memory", "1KiB", "--json")
    assert res.exit_code == 0 and json.loads(res.output)["fits"] is False
    assert "does not fit in 1.02 KB" in run("plan", art_path, "--memory", "1KiB").output


def _real_demo(run, tmp_path, request):
    import lct
    res = run("demo", "--workdir", tmp_path / "demo")
    assert res.exit_code == 0, res.output
    assert "verify: OK" in res.output
    assert "lossless tensors bit-identical" in res.output
    assert "convert" in res.output and "safetensors" in res.output
    art = tmp_path / "demo" / "model.lct"
    assert (art / "lct.json").exists()
    assert lct.verify(art).ok


def _real_cache(run, tmp_path, request):
    """A load with --cache fills it, ``lct cache list`` shows the entry, ``prune --all``
    removes it (tests/test_cache.py has the rest)."""
    monkeypatch = request.getfixturevalue("monkeypatch")
    monkeypatch.setenv("LCT_CACHE_DIR", str(tmp_path / "cache"))
    art_path = request.getfixturevalue("llama_art")
    assert run("load", art_path, "--cache", "-q").exit_code == 0
    res = run("cache", "list")
    assert res.exit_code == 0 and str(art_path) in res.output and "1 entry" in res.output
    res = run("cache", "prune", "--all")
    assert res.exit_code == 0 and "removed 1 entry" in res.output


REAL_RUNS = {"convert": _real_convert, "info": _real_info, "verify": _real_verify,
             "export": _real_export, "load": _real_load, "push": _real_push, "pull": _real_pull,
             "plan": _real_plan, "demo": _real_demo, "cache": _real_cache}


def test_every_command_is_covered():
    """A new command fails here until it has a help test (parametrized over COMMANDS) and a
    real run in REAL_RUNS."""
    assert set(REAL_RUNS) == set(COMMANDS)
    top = CliRunner().invoke(cli, ["--help"], terminal_width=200).output
    listed = re.findall(r"^  ([a-z][a-z0-9-]*)  ", top.split("Commands:")[1], re.M)
    assert sorted(listed) == sorted(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_runs(run, tmp_path, request, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    assert name in REAL_RUNS, f"no real run of `lct {name}` in REAL_RUNS"
    REAL_RUNS[name](run, tmp_path, request)


def test_convert_info_verify_export(run, llama_src, tmp_path):
    out = tmp_path / "m.lct"
    res = run("convert", llama_src, "-o", out)
    assert res.exit_code == 0, res.output
    assert "wrote" in res.output and "groups" in res.output
    res = run("info", out)
    assert res.exit_code == 0
    for word in ("embed", "layers.0", "layers.1", "norm", "head", "nf4", "bfloat16", "total"):
        assert word in res.output
    res = run("info", out, "--manifest")
    assert json.loads(res.output)["format"] == "lct"
    summary = json.loads(run("info", out, "--json").output)
    for key in ("path", "format_version", "source", "policy", "groups", "stored_bytes",
                "decoded_bytes", "source_bytes", "ratio", "side_files"):
        assert key in summary, key
    assert summary["stored_bytes"] == sum(g["stored_bytes"] for g in summary["groups"])
    res = run("verify", out, "--against", llama_src)
    assert res.exit_code == 0, res.output
    assert "OK" in res.output and "lm_head.weight" in res.output and "bit-identical" in res.output
    res = run("export", out, tmp_path / "hf")
    assert res.exit_code == 0
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    ref = load_file(llama_src / "model.safetensors")
    assert torch.equal(exported["model.layers.0.mlp.up_proj.weight"],
                       ref["model.layers.0.mlp.up_proj.weight"])


def test_convert_options(run, gemma_src, tmp_path):
    res = run("convert", gemma_src, "-o", tmp_path / "a.lct", "--nf4", "none", "--dtype",
              "float16", "--level", "3")
    assert res.exit_code == 0, res.output
    m = json.loads((tmp_path / "a.lct" / "lct.json").read_text())
    assert m["policy"]["nf4"] == [] and m["policy"]["dtype"] == "float16"
    assert m["policy"]["level"] == 3
    res = run("convert", gemma_src, "-o", tmp_path / "b.lct", "--nf4", "tail")
    assert res.exit_code != 0 and "tail" in res.output


def test_verify_against_changed_source_fails(run, gemma_src, gemma_art, tmp_path):
    from safetensors.torch import save_file
    src = tmp_path / "src"
    shutil.copytree(gemma_src, src)
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][0, 0] += 1
    save_file(tensors, src / "model.safetensors")
    res = run("verify", gemma_art, "--against", src)
    assert res.exit_code == 1
    assert "model.layers.1.mlp.up_proj.weight" in res.output


def test_verify_against_source_whose_nf4_table_differs_fails(run, gemma_src, gemma_art,
                                                              tmp_path):
    """The NF4 embedding is checked too: the source quantized again must give the stored bytes
    (a changed source row fails, where a verify that only measured error would pass)."""
    from safetensors.torch import save_file
    src = tmp_path / "src"
    shutil.copytree(gemma_src, src)
    tensors = load_file(src / "model.safetensors")
    row = tensors["model.embed_tokens.weight"][7]
    row[3] = row.abs().max() * 0.5  # one value inside the block's range: absmax unchanged
    save_file(tensors, src / "model.safetensors")
    res = run("verify", gemma_art, "--against", src)
    assert res.exit_code == 1
    assert "model.embed_tokens.weight: NF4 codes differ" in res.output
    assert run("verify", gemma_art, "--against", gemma_src).exit_code == 0


@pytest.mark.parametrize("args,fragment", [
    (["info", "/nonexistent/x.lct"], "no such artifact"),
    (["convert", "/nonexistent/model", "-o", "OUT"], "no such folder"),
    (["verify", "/nonexistent/x.lct"], "no such artifact"),
])
def test_errors_are_one_line(run, tmp_path, args, fragment, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = run(*args)
    assert res.exit_code == 1
    assert fragment in res.output
    assert "Traceback" not in res.output
    assert res.output.strip().count("\n") == 0


def test_debug_env_shows_traceback(tmp_path, monkeypatch):
    monkeypatch.setenv("LCT_DEBUG", "1")
    res = CliRunner().invoke(cli, ["info", str(tmp_path / "nope")])
    assert res.exit_code == 1 and "Traceback" in res.output



def test_a_programming_error_is_a_traceback_not_a_line(llama_art, monkeypatch):
    """The CLI turns LCT's errors into one line and nothing else: a KeyError from a bug (it
    caught bare KeyError, FileNotFoundError and PermissionError too, and printed ``error:
    'x'``) propagates with its traceback."""
    import lct.io.info

    def broken(*a, **k):
        raise KeyError("x")
    monkeypatch.setattr(lct.io.info, "summarize", broken)
    res = CliRunner().invoke(cli, ["info", str(llama_art)])
    assert isinstance(res.exception, KeyError) and "error: 'x'" not in res.output


def test_deliberate_raises_in_the_library_are_lct_errors():
    """Every ``raise`` of a builtin exception class in LCT's own code (lct/, loader/, kernels/,
    cli/) is one of LCT's typed errors instead (lct/errors.py), each also the builtin it
    resembles: what reaches a user is one line, what reaches a caller can be caught either way."""
    import ast

    root = Path(__file__).resolve().parents[1]
    builtin = {n for n in dir(__builtins__ if isinstance(__builtins__, dict) else
                             __builtins__) if n.endswith(("Error", "Exception"))} | \
        {"ValueError", "RuntimeError", "KeyError", "IndexError", "TypeError", "OSError"}
    # safetensors' SafetensorError of a failed write, made the OSError the OS gave, so that the
    # callers' one-line write errors (lct.io.writer.write_error) see its errno and file; and
    # sha256_file's refusal of a FIFO or device (EINVAL), an OSError as the open's own failures
    # are, which its callers turn into their one-line errors with e.strerror
    allowed = {("lct/format/files.py", "OSError"), ("lct/hashing.py", "OSError")}
    found = []
    for folder in ("lct", "loader", "kernels", "cli"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and \
                        isinstance(node.exc.func, ast.Name) and node.exc.func.id in builtin \
                        and (str(path.relative_to(root)), node.exc.func.id) not in allowed:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.exc.func.id}")
    assert not found, "\n".join(found)


def test_typed_errors_keep_their_builtin_and_read_as_one_line(llama_art):
    import lct
    from lct.errors import EntryNotFoundError, LCTError, OptionError
    with lct.open(llama_art) as art:
        with pytest.raises(EntryNotFoundError) as e:
            art.read_tensor("nope")
        assert isinstance(e.value, (LCTError, KeyError))
        assert str(e.value).endswith("no tensor named 'nope'")    # not quoted as a key is
        with pytest.raises(OptionError, match="prefetch must be an integer >= 0"):
            art.stream(prefetch=-1)
    with pytest.raises(OptionError, match="nf4 must be one of keep, dequantize"):
        lct.load(llama_art, nf4="sometimes")

def test_load_prefetch_has_the_librarys_one_rule(run, llama_art):
    """Issue 37: prefetch is validated once, by the load (lct.io.stream.check_prefetch through
    LoadOptions): lct load --prefetch had a rule of its own (click's IntRange(0, 64)), refusing
    a window lct.load takes."""
    res = run("load", llama_art, "--prefetch", "-1", "--ids", "1,5", "--max-new-tokens", "1")
    assert res.exit_code == 1, res.output
    assert res.output.strip() == "error: prefetch must be an integer >= 0, got -1 (--prefetch)"
    res = run("load", llama_art, "--prefetch", "65", "--ids", "1,5", "--max-new-tokens", "1",
              "--json")
    assert res.exit_code == 0, res.output       # click's IntRange refused it (exit 2)
    out = json.loads(res.output)
    assert out["new_tokens"] == 1 and out["breakdown"]["max_in_flight"] == out["breakdown"]["groups"]


@pytest.mark.parametrize("args,fragment,code", [
    (["--ids", "1,99999"], "token id 99999 is outside the vocabulary", 1),
    (["--ids", "-1"], "token id -1 is outside the vocabulary", 1),
    (["--ids", ","], "give at least one token id", 2),
    (["--ids", "1,,2"], "got 'an empty one' in '1,,2'", 2),
    (["--ids", "1,x"], "got 'x' in '1,x'", 2),
    (["--ids", "1", "--prompt", "hi"], "give --prompt or --ids, not both", 2),
    (["--device", "tpu", "--ids", "1"], "is not 'cpu' or 'cuda[:N]'", 1),
])
def test_load_bad_input_is_one_line(run, llama_art, args, fragment, code):
    res = run("load", llama_art, *args)
    assert res.exit_code == code and fragment in res.output and "Traceback" not in res.output


def test_load_on_cuda_without_cuda_is_one_line(run, llama_art):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    res = run("load", llama_art, "--device", "cuda", "--ids", "1")
    assert res.exit_code == 1 and "CUDA is not available" in res.output


def test_nf4_embedding_refuses_out_of_range_ids(llama_art):
    import torch

    import lct
    model = lct.load(llama_art)
    with pytest.raises(IndexError, match="ids must be in"):
        model.get_input_embeddings()(torch.tensor([[-1, 2]]))


def test_outputs_in_the_way_are_one_line(run, llama_src, llama_art, tmp_path):
    (tmp_path / "afile").write_text("user data")
    (tmp_path / "alink").symlink_to(tmp_path / "afile")
    cases = [(["convert", llama_src, "-o", tmp_path / "afile" / "x.lct"], "is a file, not a folder"),
             (["export", llama_art, tmp_path / "afile" / "sub"], "is a file, not a folder"),
             (["export", llama_art, tmp_path / "afile", "--force"], "is a file, not a folder"),
             (["export", llama_art, tmp_path / "alink", "--force"], "is a symbolic link"),
             (["convert", llama_src, "-o", tmp_path / "alink", "--force"], "is a symbolic link")]
    for args, fragment in cases:
        res = run(*args)
        assert res.exit_code == 1 and fragment in res.output, (args, res.output)
    assert (tmp_path / "afile").read_text() == "user data" and (tmp_path / "alink").is_symlink()


def test_hf_address_with_an_empty_owner_is_refused():
    from lct.hub import HubURIError, parse_hf_uri
    with pytest.raises(HubURIError, match="not a Hub model address"):
        parse_hf_uri("hf:///bad")
    assert parse_hf_uri("hf://org/name/") == ("org/name", None)


def test_force_never_deletes_what_lct_did_not_write(run, llama_src, llama_art, tmp_path):
    """export/convert --force replace only folders made of their own files (issue 12 items 1-2)."""
    art = tmp_path / "a.lct"
    shutil.copytree(llama_art, art)
    out = tmp_path / "hf"
    assert run("export", art, out).exit_code == 0
    assert run("export", art, out, "--force").exit_code == 0  # an earlier export: replaced
    (out / "notes.txt").write_text("mine")
    res = run("export", art, out, "--force")
    assert res.exit_code == 1 and "'notes.txt'" in res.output and (out / "notes.txt").exists()
    for target in (art, art / "sub", tmp_path):  # the artifact, inside it, around it
        res = run("export", art, target, "--force")
        assert res.exit_code == 1 and "into, over or around the artifact" in res.output
    assert lct_ok(art)
    (art / "my-notes.md").write_text("mine")
    res = run("convert", llama_src, "-o", art, "--force")
    assert res.exit_code == 1 and "'my-notes.md'" in res.output and (art / "my-notes.md").exists()
    (art / "my-notes.md").unlink()
    assert run("convert", llama_src, "-o", art, "--force").exit_code == 0


def test_export_force_never_replaces_a_folder_an_export_did_not_write(run, llama_src, tmp_path):
    """A Hugging Face folder holds only names an export writes (the source model itself,
    perhaps): before, export --force replaced the user's source with a lossy copy; now only a
    folder carrying the export's mark is replaced, and the refusal does not send the user to
    --force. An existing empty folder is filled, by export and convert alike."""
    import hashlib
    src = tmp_path / "mysrc"
    shutil.copytree(llama_src, src)
    art = tmp_path / "mysrc.lct"
    assert run("convert", src, "-o", art).exit_code == 0
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in src.iterdir()}
    for extra in ([], ["--force"]):
        res = run("export", art, src, *extra)
        assert res.exit_code == 1 and "was not written by an export" in res.output, res.output
        assert "--force" not in res.output, res.output
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in src.iterdir()} == before
    (tmp_path / "empty").mkdir()
    assert run("export", art, tmp_path / "empty").exit_code == 0
    assert (tmp_path / "empty" / ".lct-export.json").is_file()
    res = run("export", art, tmp_path / "empty")
    assert res.exit_code == 1 and "already exists" in res.output and "--force" in res.output
    (tmp_path / "empty2").mkdir()
    assert run("convert", src, "-o", tmp_path / "empty2").exit_code == 0
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("mine")
    res = run("convert", src, "-o", tmp_path / "theirs")
    assert res.exit_code == 1 and "not an LCT artifact" in res.output
    assert "--force" not in res.output and (tmp_path / "theirs" / "notes.txt").exists()


def lct_ok(path):
    import lct
    return lct.verify(path).ok


def test_verify_against_a_different_model_is_one_line(run, gemma_art, tmp_path):
    from safetensors.torch import save_file
    other = tmp_path / "other"
    other.mkdir()
    save_file({"transformer.h.0.attn.weight": torch.zeros(4, 4)}, other / "model.safetensors")
    res = run("verify", gemma_art, "--against", other)
    assert res.exit_code == 1 and "shares no tensor name with the artifact" in res.output
    assert res.output.count("\n") == 1


def test_python_m_lct_is_the_lct_command():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "lct", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "convert" in out.stdout and "load" in out.stdout


@pytest.mark.parametrize("env", ["HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"])
def test_progress_bars_follow_the_environment(llama_src, tmp_path, monkeypatch, env):
    """Issue 14: HF_HUB_DISABLE_PROGRESS_BARS (and TQDM_DISABLE) silence LCT's bars as they
    silence huggingface_hub's; without them convert draws its bar on stderr."""
    from click.testing import CliRunner

    from lct.cli.main import cli
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    shown = CliRunner().invoke(cli, ["convert", str(llama_src), "-o", str(tmp_path / "a.lct")])
    assert shown.exit_code == 0 and "convert:" in shown.stderr
    monkeypatch.setenv(env, "1")
    quiet = CliRunner().invoke(cli, ["convert", str(llama_src), "-o", str(tmp_path / "b.lct")])
    assert quiet.exit_code == 0 and "convert:" not in quiet.stderr
    assert "wrote" in quiet.stdout


def test_help_lists_every_command_with_its_whole_summary():
    """Issue 14: each command's one-line summary shows whole (it was cut mid-sentence)."""
    from click.testing import CliRunner

    from lct.cli.main import COMMANDS, cli
    out = CliRunner().invoke(cli, ["--help"], terminal_width=200).output
    for name in COMMANDS:
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(name + " "))
        assert line.rstrip().endswith(".") and "..." not in line, line


def test_json_outputs_parse_and_carry_their_documented_fields(gemma_src, tmp_path):
    """Issue 14: --json on convert, info, verify and load prints one JSON object on stdout
    (progress stays on stderr) with the fields docs/CLI.md lists."""
    import re

    from click.testing import CliRunner

    from lct.cli.main import cli
    from lct.demo import tiny
    src = tmp_path / "src"
    shutil.copytree(gemma_src, src)
    tiny.save_tokenizer(src, vocab_size=256)
    doc = (Path(__file__).parent.parent / "docs" / "CLI.md").read_text()
    runner = CliRunner()

    def fields(command):
        section = doc.split(f"### lct {command} --json")[1].split("###")[0]
        return re.findall(r"^\| `([a-z_0-9]+)` \|", section, re.M)

    art = tmp_path / "a.lct"
    cases = [("convert", ["convert", str(src), "-o", str(art), "--json"]),
             ("info", ["info", str(art), "--json"]),
             ("verify", ["verify", str(art), "--against", str(src), "--json"]),
             ("load", ["load", str(art), "--prompt", "Hello", "--max-new-tokens", "2",
                       "--json"])]
    for command, args in cases:
        res = runner.invoke(cli, args)
        assert res.exit_code == 0, (command, res.output)
        obj = json.loads(res.stdout)
        want = fields(command)
        assert want, f"docs/CLI.md documents no fields for lct {command} --json"
        missing = [f for f in want if f not in obj]
        assert not missing, (command, missing)
    assert obj["text"] and obj["new_tokens"] >= 1


def test_readme_and_layerwise_load_agree_on_resident_layers(tmp_path):
    """Issue 14: the README's `lct load --layerwise` line states what the command measures
    (on a model with more layers than the window)."""
    import re

    from click.testing import CliRunner

    import lct
    from lct.cli.main import cli
    from lct.demo import tiny
    src = tiny.save_tiny(tmp_path / "src", "llama", num_hidden_layers=6)
    llama_art = tmp_path / "a.lct"
    lct.convert(str(src), llama_art)
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    claimed = int(re.search(r"--layerwise.*?= (\d+) layers resident", readme).group(1))
    res = CliRunner().invoke(cli, ["load", str(llama_art), "--layerwise", "--ids", "1,2,3",
                                   "--max-new-tokens", "2", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["max_resident_layers"] == claimed


def test_verbose_logs_to_stderr_and_the_library_is_silent_by_default(llama_src, tmp_path,
                                                                     caplog):
    """Issue 14: -v turns on LCT's loggers (module loggers under lct.*) on stderr; without it,
    and from Python, LCT logs nothing unless the program asks."""
    import logging

    from click.testing import CliRunner

    import lct
    from lct.cli.main import cli
    res = CliRunner().invoke(cli, ["-v", "convert", str(llama_src), "-o", str(tmp_path / "a.lct")])
    assert res.exit_code == 0, res.output
    assert "lct.conversion.converter:" in res.stderr and "embed/head stored as" in res.stderr
    assert "lct.conversion.converter" not in res.stdout
    logging.getLogger("lct").handlers = [h for h in logging.getLogger("lct").handlers
                                         if isinstance(h, logging.NullHandler)]
    logging.getLogger("lct").setLevel(logging.NOTSET)
    res = CliRunner().invoke(cli, ["convert", str(llama_src), "-o", str(tmp_path / "b.lct")])
    assert "lct.conversion.converter:" not in res.stderr
    with caplog.at_level(logging.INFO, logger="lct"):
        lct.convert(str(llama_src), tmp_path / "c.lct")
    assert any(r.name == "lct.conversion.converter" for r in caplog.records)


def test_every_command_has_quiet_and_it_prints_only_the_result(gemma_src, tmp_path):
    """Issue 14: -q/--quiet on every command prints nothing but the result on stdout (the path,
    the verdict, the generated text) and nothing on stderr; push and pull are tested against
    the loopback Hub in test_hub.py."""
    from click.testing import CliRunner

    from lct.cli.main import COMMANDS, cli
    from lct.demo import tiny
    runner = CliRunner()
    for name in _subcommands():
        help_text = runner.invoke(cli, [*name.split(), "--help"]).output
        assert "-q, --quiet" in help_text, name
    src = tmp_path / "src"
    shutil.copytree(gemma_src, src)
    tiny.save_tokenizer(src, vocab_size=256)
    art = tmp_path / "a.lct"

    def quiet(*args):
        res = runner.invoke(cli, [str(a) for a in args] + ["-q"])
        assert res.exit_code == 0, (args, res.output)
        assert res.stderr == "", (args, res.stderr)
        return res.stdout

    assert quiet("convert", src, "-o", art) == f"{art}\n"
    assert quiet("export", art, tmp_path / "hf") == f"{tmp_path / 'hf'}\n"
    assert quiet("verify", art, "--against", src) == "OK\n"
    line = quiet("info", art)
    assert line.startswith(f"{art}: LCT 1.") and line.count("\n") == 1 and "stored" in line
    text = quiet("load", art, "--prompt", "Hello", "--max-new-tokens", "3")
    full = runner.invoke(cli, ["load", str(art), "--prompt", "Hello", "--max-new-tokens", "3"])
    assert f"output: {text}" in full.stdout and text.count("\n") == 1
    assert quiet("load", art) == ""
    empty = runner.invoke(cli, ["load", str(art), "--prompt", ""])
    assert empty.exit_code == 1 and "the prompt '' encodes to no tokens" in empty.stderr and \
        "Traceback" not in empty.output
    assert re.fullmatch(r"peak [\d.]+ [KMG]B; fits in [\d.]+ GB\n",
                        quiet("plan", art, "--memory", "16GiB"))
    assert quiet("demo", "--workdir", tmp_path / "demo") == f"{tmp_path / 'demo'}\n"

    # A failure still says what is wrong (stderr) and exits 1; stdout has the verdict only.
    bad = _damaged_copy(art, tmp_path / "bad.lct")
    res = runner.invoke(cli, ["verify", str(bad), "-q"])
    assert res.exit_code == 1 and res.stdout == "FAILED\n" and "FAIL " in res.stderr
    # an error that stops the check (a truncated data file) is a verdict too, on stdout
    import json
    shutil.copytree(art, tmp_path / "short.lct")
    data = next((tmp_path / "short.lct").glob("model-*.lct"))
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    res = runner.invoke(cli, ["verify", str(tmp_path / "short.lct"), "-q"])
    assert res.exit_code == 1 and res.stdout == "FAILED\n" and "truncated" in res.stderr
    res = runner.invoke(cli, ["verify", str(tmp_path / "short.lct"), "--json"])
    out = json.loads(res.stdout)
    assert res.exit_code == 1 and out["ok"] is False and "truncated" in out["error"]


def test_load_with_a_prompt_reports_the_missing_artifact_first(run, llama_art, tmp_path):
    """A folder that is not an artifact is named as such even with --prompt (the tokenizer
    check came first and said the 'artifact' had no tokenizer), and the tokenizer refusal
    gives its hint once."""
    (tmp_path / "empty").mkdir()
    res = run("load", tmp_path / "empty", "--prompt", "hi")
    assert res.exit_code == 1 and "not an LCT artifact" in res.output, res.output
    res = run("load", llama_art, "--prompt", "hi")
    assert res.exit_code == 1 and "no tokenizer to encode a prompt" in res.output
    assert res.output.count("token ids") == 1, res.output


def test_readme_gives_a_fast_tier_and_ci_runs_the_whole_suite():
    """Issue 22.17: the README's test command ran 25 minutes with no hint of its length. The
    `slow` marker is registered, the README gives the fast tier's command and says how long
    each takes, the slowest tests carry the mark, and CI still runs everything."""
    import tomllib
    root = Path(__file__).parent.parent
    markers = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]["markers"]
    assert any(m.startswith("slow:") for m in markers), markers
    readme = (root / "README.md").read_text()
    fast = 'python -m pytest -q tests -m "not slow"'
    assert fast in readme and "python -m pytest -q tests\n" in readme
    sentence = readme[readme.index(fast):].split("\n\n")[0]
    assert re.search(r"\d[\d½.]* (s|seconds|minutes?)\b", sentence), sentence
    ci = (root / ".ci" / "run").read_text()
    assert "python -m pytest -q tests\n" in ci and "not slow" not in ci
    import test_crash
    import test_tensor_parallel
    assert any(m.name == "slow" for m in [test_tensor_parallel.pytestmark])
    assert any(m.name == "slow" for m in getattr(
        test_crash.test_sigkill_at_any_instant_leaves_the_old_or_the_new, "pytestmark", []))


def test_convert_info_and_demo_print_one_ratio_in_one_unit_system(run, gemma_src, tmp_path):
    """Issue 22.17: convert printed 0.663x (chunks over tensor bytes), info 0.624x (chunks over
    every source file), and the planner MiB where info printed MB. One ratio now, the .lct data
    files over the source's .safetensors files, as both print it and their JSON carries it;
    and every size in decimal units."""
    from lct.io.info import size_ratio
    art = tmp_path / "a.lct"
    conv = run("convert", gemma_src, "-o", art)
    assert conv.exit_code == 0, conv.output
    on_disk = sum(p.stat().st_size for p in art.glob("*.lct")) / \
        sum(p.stat().st_size for p in gemma_src.glob("*.safetensors"))
    with lct_open(art) as a:
        assert size_ratio(a.manifest) == pytest.approx(on_disk)
    said = f"{on_disk:.3f}x"
    info = run("info", art)
    assert said in conv.output and said in info.output, (conv.output, info.output)
    assert re.findall(r"\d\.\d{3}x", conv.output) == [said], conv.output
    assert re.findall(r"\d\.\d{3}x", info.output) == [said], info.output
    assert ".lct data files ÷ the source's .safetensors files" in info.output
    doc = (Path(__file__).parent.parent / "docs" / "CLI.md").read_text()
    assert ".lct data files ÷ the source's .safetensors files" in doc
    j_info = json.loads(run("info", art, "--json").output)
    j_conv = json.loads(run("convert", gemma_src, "-o", art, "--force", "--json").output)
    assert j_info["ratio"] == pytest.approx(on_disk) and j_conv["ratio"] == pytest.approx(on_disk)
    plan = run("plan", art, "--maximus-resident", "2/8", "--memory", "1GiB")
    assert plan.exit_code == 0, plan.output
    for out in (plan.output, info.output, conv.output):
        assert not re.search(r"\d (KiB|MiB|GiB|TiB)\b", out), out
    assert re.search(r"\d (KB|MB|GB)\b", plan.output)


def lct_open(path):
    import lct
    return lct.open(path)


def test_info_and_load_on_a_hugging_face_checkpoint_say_convert_it(run, llama_src):
    """Issue 22.17: `lct info` on a checkpoint folder said only "not an LCT artifact (no
    lct.json)". It says, in one line, that it is a Hugging Face checkpoint to convert first,
    and the command to do it; `lct load` and `lct verify`, which open it the same way, too."""
    for args in (["info", llama_src], ["load", llama_src], ["verify", llama_src]):
        res = run(*args)
        _one_line_error(res, "a Hugging Face checkpoint")
        assert "convert it to one first" in res.output and "lct convert " in res.output, \
            res.output


@pytest.mark.parametrize("typo, meant", [("convrt", "convert"), ("inf", "info"),
                                         ("plna", "plan"), ("lod", "load")])
def test_a_mistyped_command_gets_a_did_you_mean(typo, meant):
    """Issue 22.17: `lct convrt` said only "No such command": click (8.5) suggests close
    option names, not command names. One line, exit status 2, the closest command named."""
    res = CliRunner().invoke(cli, [typo])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert f"Did you mean '{meant}'?" in res.output, res.output
    res = CliRunner().invoke(cli, ["qqqqq"])
    assert res.exit_code == 2 and "Did you mean" not in res.output, res.output


def test_demo_without_a_workdir_leaves_nothing_behind(tmp_path, monkeypatch):
    """Issue 22.17: every `lct demo` left its 29 MB in a new temporary folder. Without
    --workdir the folder is removed when the demo ends (also when it fails); with --workdir
    the files stay there."""
    import tempfile

    import lct.demo.run as demo
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []

    def fake(work, log):        # the demo's steps, which write their files under ``work``
        (work / "model.lct").mkdir(parents=True)
        (work / "model.lct" / "data.lct").write_bytes(b"\0" * 1000)
        seen.append(work)
        return demo.DemoResult(work, verify_ok=True, load_agrees=True)
    monkeypatch.setattr(demo, "_run", fake)
    res = demo.run_demo()
    assert res.workdir is None and seen[0].parent == tmp_path and list(tmp_path.iterdir()) == []
    out = CliRunner().invoke(cli, ["demo", "-q"])
    assert out.exit_code == 0 and out.stdout == "OK\n" and list(tmp_path.iterdir()) == []

    def failing(work, log):
        (work / "half").write_bytes(b"x")
        raise RuntimeError("a step failed")
    monkeypatch.setattr(demo, "_run", failing)
    with pytest.raises(RuntimeError):
        demo.run_demo()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(demo, "_run", fake)
    kept = tmp_path / "keep"
    assert demo.run_demo(kept).workdir == kept and (kept / "model.lct" / "data.lct").is_file()


@pytest.mark.slow
def test_the_demo_leaves_no_decoded_cache_entry_behind(tmp_path, monkeypatch):
    """A new user's trial: every `lct demo` left its artifact's decoded copy in the cache after
    removing the artifact (and `--workdir` one more each run): nothing would map them again.
    With the cache on, as a user has it, a demo in a temporary folder leaves no entry, and one
    in a kept folder leaves only its current artifact's."""
    import lct.demo.run as demo
    from lct.io import cache
    monkeypatch.setenv(cache.ENV_SWITCH, "1")
    monkeypatch.setenv(cache.ENV_DIR, str(tmp_path / "cache"))
    kept = tmp_path / "kept"
    for _ in range(2):
        demo.run_demo(kept, log=lambda *a: None)
        cache.wait_fills()
        (entry,) = cache.entries()
        assert entry.digest == demo._digest(kept / "model.lct")
    demo.run_demo(log=lambda *a: None)
    cache.wait_fills()
    assert [e.digest for e in cache.entries()] == [entry.digest]


def test_demo_never_replaces_what_it_did_not_write(tmp_path, monkeypatch):
    """A new user's trial: `lct demo --workdir DIR` replaced the user's own `source` (their
    model's weights) and `model.lct` in DIR. Now a folder holding any of the demo's outputs that
    an earlier demo did not write is refused before anything is written, by name; a file is
    refused in one line; a folder an earlier demo wrote is reused."""
    import lct.demo.run as demo

    def fake(work, log):
        for name in demo.OUTPUTS:
            (work / name).mkdir(exist_ok=True)
            (work / name / "x").write_text("demo")
        return demo.DemoResult(work, verify_ok=True, load_agrees=True)
    monkeypatch.setattr(demo, "_run", fake)
    mine = tmp_path / "mine"
    (mine / "source").mkdir(parents=True)
    (mine / "source" / "model.safetensors").write_bytes(b"my weights")
    out = CliRunner().invoke(cli, ["demo", "--workdir", str(mine), "-q"])
    assert out.exit_code == 1 and out.output.count("\n") == 1, out.output
    assert f"{mine / 'source'} exists and lct demo did not write it" in out.output
    assert sorted(p.name for p in mine.rglob("*")) == ["model.safetensors", "source"]
    afile = tmp_path / "afile"
    afile.write_text("notes")
    out = CliRunner().invoke(cli, ["demo", "--workdir", str(afile), "-q"])
    assert out.exit_code == 1 and "is a file, not a folder" in out.output, out.output
    assert afile.read_text() == "notes"
    fresh = tmp_path / "fresh"
    for _ in range(2):          # the second run replaces the first one's outputs
        out = CliRunner().invoke(cli, ["demo", "--workdir", str(fresh), "-q"])
        assert out.exit_code == 0 and out.output == f"{fresh}\n", out.output


@pytest.mark.parametrize("command", ["convert", "load"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_workers_is_checked_alike_by_convert_and_load(command, value, gemma_src, gemma_art,
                                                      tmp_path):
    """A new user's trial: `convert --workers -3` ended in a traceback after the calibration
    and `--workers 0` meant all cores, where load refused both. One check, before any work."""
    args = ([str(gemma_src), "-o", str(tmp_path / "x.lct")] if command == "convert" else
            [str(gemma_art), "--ids", "1,2"])
    out = CliRunner().invoke(cli, [command, *args, "--workers", value])
    assert out.exit_code == 1 and out.output.count("\n") == 1, out.output
    assert f"workers must be an integer >= 1 (or None: all cores), got {value}" in out.output
    assert not (tmp_path / "x.lct").exists()
    import lct
    from lct.errors import OptionError
    with pytest.raises(OptionError, match="workers must be"):
        lct.convert(str(gemma_src), tmp_path / "y.lct", workers=int(value))


@pytest.mark.parametrize("flag", ["--q6_k", "--q8_0", "--int8_b128"])
def test_an_error_names_the_flag_as_the_command_spells_it(flag, gemma_src, tmp_path):
    """A new user's trial: the hint said `(--q6-k)`, a flag that does not exist (the command's
    is `--q6_k`); the hint is now the flag the command declares."""
    out = CliRunner().invoke(cli, ["convert", str(gemma_src), "-o", str(tmp_path / "x.lct"),
                                   flag, "head"])
    assert out.exit_code == 1 and out.output.rstrip().endswith(f"({flag})"), out.output


@pytest.mark.parametrize("scheme", ["https", "ftp"])
def test_an_address_lct_does_not_speak_is_refused_not_taken_for_a_folder(scheme, gemma_src,
                                                                          gemma_art, tmp_path,
                                                                          monkeypatch):
    """A new user's trial: `lct info gs://bucket/x` said `gs:/bucket/x: no such artifact
    directory`, and `lct convert ... -o gs://b/x` wrote a local folder named `gs:` (gs:// and
    az:// are object stores LCT speaks now, tests/test_cloud.py). Every command that reads or
    writes an artifact refuses an address of another scheme by its scheme."""
    monkeypatch.chdir(tmp_path)
    url = f"{scheme}://bucket/x"
    for args in (["info", url], ["load", url, "--ids", "1"], ["verify", url],
                 ["convert", str(gemma_src), "-o", url], ["export", str(gemma_art), url]):
        out = CliRunner().invoke(cli, args)
        assert out.exit_code == 1 and out.output.count("\n") == 1, (args, out.output)
        assert f"{url}: {scheme}:// is not an address LCT reads or writes" in out.output
    assert list(tmp_path.iterdir()) == []


def test_an_artifact_given_to_convert_is_named_as_one(gemma_art, tmp_path):
    """A new user's trial: `lct convert ART -o X` said only "not a model folder"."""
    out = CliRunner().invoke(cli, ["convert", str(gemma_art), "-o", str(tmp_path / "x.lct")])
    assert out.exit_code == 1 and "an LCT artifact, not a model folder" in out.output and \
        f"lct export {gemma_art} DIR" in out.output, out.output



def test_verify_refuses_a_malformed_expect_before_checking(run, llama_art):
    """Found by a new user: --expect sha256:deadbeef ran the whole verify, then listed the
    malformed digest as the artifact's failure."""
    res = run("verify", llama_art, "--expect", "sha256:deadbeef")
    assert res.exit_code == 1 and "give sha256:<64 hex digits>" in res.output
    assert "chunks checked" not in res.output and "FAIL " not in res.output
