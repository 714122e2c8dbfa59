"""vLLM's ``--load-format lct`` (loader/vllm.py) on a multimodal model: a tiny Idefics3 (SigLIP-like
vision tower, pixel-shuffle connector, Llama text model) serves, from its artifact, the greedy
tokens vLLM's default loader serves from the source's safetensors, for text-only prompts and for
prompts with an image. The image prompts are what shows that the lct loader feeds the vision
tower and the connector: vLLM 0.32's ``track_weights_loading`` (which the loader calls) exempts,
on an unquantized model, every module whose quant method post-processes its weights, which is
every linear layer (``UnquantizedLinearMethod``): it catches a norm or a position embedding left
unloaded, not a projection. A vision projection left out serves the text-only prompts' tokens
unchanged and an image's differently; here each image gives tokens of its own.

Why Idefics3: vLLM 0.32's Gemma3 (``gemma3_mm.py``), LLaVA (``llava.py``, through ``pixtral.py``),
Mistral3/Pixtral and Qwen2-VL/Qwen2.5-VL (``qwen2_vl.py``) modules import transformers' image
processors that need torchvision, which vLLM's CPU environment does without (its builds break
``import vllm``): those architectures cannot even be inspected there. Idefics3's module takes
transformers' PIL image processor (``Idefics3ImageProcessorPil``) and handles its layout.

The helpers (main environment, engine environment, token parsing) are test_vllm.py's; each
engine runs in a fresh process, in-process engine, eager, one rank, offline.
"""

import json
import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:       # pytest's default import mode puts it there; any other does not
    sys.path.insert(0, _HERE)
from test_vllm import (
    ENGINE_TIMEOUT,
    PROMPTS,
    _lct,
    _main_python,
    _run,
    _steps,
    engine_env,
    tokens,
)

__all__ = ["engine_env"]        # the session fixture, shared with test_vllm.py

# The source, built in the main environment: LCT's tiny tokenizer with Idefics3's image tokens
# added, a Llama text model (heads of 32: vLLM's CPU attention has no kernel for 16), a vision
# tower of 64x64 images in 16x16 patches (16 patches, 4 image tokens after the connector's 2x2
# pixel shuffle), and the processor's settings (processor_config.json, which transformers 5.19,
# vLLM's, reads the image processor from): one 64x64 tile per image, no splitting.
BUILD_IDEFICS3 = """
import json, sys
from pathlib import Path
from lct.demo import tiny
from transformers import AutoTokenizer, Idefics3ForConditionalGeneration
out = Path(sys.argv[1])
tiny.save_tokenizer(out, vocab_size=256)
tok = AutoTokenizer.from_pretrained(out)
tok.add_special_tokens({"additional_special_tokens": [
    "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]})
tok.save_pretrained(out)
base = tiny.tiny_config("idefics3")
text = {**base.text_config.to_dict(), "vocab_size": 320, "hidden_size": 128,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "max_position_embeddings": 512, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2}
vision = {**base.vision_config.to_dict(), "hidden_size": 128, "intermediate_size": 256,
          "num_attention_heads": 4, "image_size": 64, "patch_size": 16}
for d in (text, vision):
    d.pop("model_type")
    d.pop("transformers_version", None)
tiny.save_tiny(out, "idefics3", model_class=Idefics3ForConditionalGeneration, text_config=text,
               vision_config=vision, scale_factor=2, pad_token_id=0,
               image_token_id=tok.convert_tokens_to_ids("<image>"))
(out / "processor_config.json").write_text(json.dumps({
    "processor_class": "Idefics3Processor", "image_seq_len": 4,
    "image_processor": {
        "image_processor_type": "Idefics3ImageProcessor", "do_convert_rgb": True,
        "do_resize": True, "size": {"longest_edge": 64}, "resample": 1,
        "do_image_splitting": False, "max_image_size": {"longest_edge": 64},
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_pad": True}},
    indent=1))
"""

# Like test_vllm.py's GENERATE, with prompts that may carry an image: ``{"prompt": text,
# "image": [width, height, fill]}``, fill an RGB colour or the seed of random pixels; the image
# is made here, in the engine's process, with PIL (vLLM's environment has it).
GENERATE = """
import gc, json, sys
def image(width, height, fill):
    import numpy as np
    from PIL import Image
    if isinstance(fill, int):
        a = np.random.default_rng(fill).integers(0, 256, (height, width, 3), dtype=np.uint8)
    else:
        a = np.broadcast_to(np.array(fill, dtype=np.uint8), (height, width, 3)).copy()
    return Image.fromarray(a)
def main():
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    models, fmt, prompts = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    inputs = [p if isinstance(p, str) else
              {"prompt": p["prompt"], "multi_modal_data": {"image": image(*p["image"])}}
              for p in prompts]
    runs = []
    for model in models:
        llm = LLM(model=model, load_format=fmt, dtype="bfloat16", enforce_eager=True,
                  max_model_len=128, seed=0, distributed_executor_backend="uni",
                  limit_mm_per_prompt={"image": 1})
        out = llm.generate(inputs, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        runs.append([list(o.outputs[0].token_ids) for o in out])
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    print("TOKENS " + json.dumps(runs))
if __name__ == "__main__":
    main()
"""

# Images alone as the prompt (what the model then says depends on nothing else): black, white,
# red, random pixels; and one inside text, 80x48, which the processor resizes and pads to its
# 64x64 tile.
IMAGES = [{"prompt": "<image>", "image": [64, 64, [0, 0, 0]]},
          {"prompt": "<image>", "image": [64, 64, [255, 255, 255]]},
          {"prompt": "<image>", "image": [64, 64, [255, 0, 0]]},
          {"prompt": "<image>", "image": [64, 64, 0]},
          {"prompt": "the quick <image> brown fox", "image": [80, 48, [0, 0, 255]]}]
MM_PROMPTS = [*PROMPTS, *IMAGES]

# The default artifact's lossy tensors: the text model's embedding and head only; the vision
# tower and the connector stay lossless.
TEXT_TABLES = {"model.text_model.embed_tokens.weight", "lm_head.weight"}


def generate(env, folders, load_format="auto"):
    """vLLM's greedy tokens of ``MM_PROMPTS`` on each of ``folders``, served one after the
    other in one fresh process."""
    env = dict(env, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return _run([sys.executable, "-c", GENERATE, json.dumps([str(f) for f in folders]),
                 load_format, json.dumps(MM_PROMPTS)], env=env,
                timeout=ENGINE_TIMEOUT * len(folders))


@pytest.fixture(scope="session")
def mm_models(tmp_path_factory):
    """``{name: folder}``: the tiny Idefics3 (``idefics3``), its lossless artifact
    (``idefics3.lct``), its default artifact (``default.lct``: the auto policy's lossy text
    embedding and head) and that one's ``lct export`` (``default-export``)."""
    d = tmp_path_factory.mktemp("vllm-multimodal")
    py = _main_python()
    src = d / "idefics3"
    _steps([[py, "-c", BUILD_IDEFICS3, str(src)],
            _lct(py, "convert", src, "-o", d / "idefics3.lct", "--nf4", "none"),
            _lct(py, "convert", src, "-o", d / "default.lct"),
            _lct(py, "export", d / "default.lct", d / "default-export")])
    return {p.name: p for p in d.iterdir()}


@pytest.fixture(scope="session")
def mm_reference(mm_models, engine_env):
    """``{name: tokens}``: the default loader's tokens on the source and on the export."""
    names = ["idefics3", "default-export"]
    return dict(zip(names, tokens(generate(engine_env, [mm_models[n] for n in names]))))


@pytest.fixture(scope="session")
def mm_served(mm_models, engine_env):
    """``({name: tokens}, log)``: the lct loader's tokens on both artifacts, one process."""
    names = ["idefics3.lct", "default.lct"]
    res = generate(engine_env, [mm_models[n] for n in names], "lct")
    return dict(zip(names, tokens(res))), res.stdout + res.stderr     # vLLM logs to stdout


def _manifest(folder) -> dict:
    return json.loads((Path(folder) / "lct.json").read_text())


def test_the_artifacts_hold_the_vision_tower(mm_models):
    """Every source tensor is in each artifact (the vision tower's, the connector's);
    lossless but for the default artifact's text embedding and head."""
    from safetensors import safe_open
    with safe_open(str(mm_models["idefics3"] / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert any(n.startswith("model.vision_model.encoder.layers.") for n in names), names
    assert any(n.startswith("model.connector.") for n in names), names
    for art, lossy in [("idefics3.lct", set()), ("default.lct", TEXT_TABLES)]:
        tensors = _manifest(mm_models[art])["tensors"]
        assert {t["name"] for t in tensors} == names, art
        assert {t["name"] for t in tensors if t["encoding"] != "plain"} == lossy, art
    assert (mm_models["idefics3.lct"] / "processor_config.json").read_text() == \
        (mm_models["idefics3"] / "processor_config.json").read_text()


def test_the_image_decides_the_tokens(mm_reference):
    """The reference itself: each image alone as the prompt gives tokens of its own, so the
    vision tower and the connector reach the tokens (a weight of theirs loaded wrong would
    show in the comparison below)."""
    ref = mm_reference["idefics3"]
    alone = [tuple(ref[len(PROMPTS) + i]) for i, p in enumerate(IMAGES) if p["prompt"] == "<image>"]
    assert len(set(alone)) == len(alone), alone


@pytest.mark.parametrize("artifact,source", [
    ("idefics3.lct", "idefics3"),           # lossless: the source itself
    ("default.lct", "default-export"),      # NF4 text embedding/head: what lct export writes
])
def test_a_multimodal_artifact_serves_the_default_loaders_tokens(mm_served, mm_reference,
                                                                 artifact, source):
    served, log = mm_served
    assert log.count("(LCT: ") == len(served) and "Loading weights took" in log, log[-4000:]
    got, ref = served[artifact], mm_reference[source]
    assert got[:len(PROMPTS)] == ref[:len(PROMPTS)], "text-only prompts"
    assert got[len(PROMPTS):] == ref[len(PROMPTS):], "prompts with an image"
