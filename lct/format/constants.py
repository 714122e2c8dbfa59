"""Every number of the LCT format, in one place (see docs/FORMAT.md)."""

FORMAT_NAME = "lct"
FORMAT_VERSION = (1, 6)
MAX_VERSION_NUMBER = 0xFFFF             # major and minor are u16s in the data file header

MANIFEST_NAME = "lct.json"
DATA_FILE_TEMPLATE = "model-{index:05d}.lct"
DATA_FILE_PATTERN = r"model-[0-9]{5}\.lct"
DATA_FILE_GLOB = "model-*.lct"            # the same names as a glob (tools that take globs)
DATA_MAGIC = b"LCTDATA\x00"
DATA_HEADER_SIZE = 4096
# The data file header's fields (FORMAT.md section 3): magic, u16 major, u16 minor,
# u32 file index, the 16 bytes of the artifact id; every byte after them up to
# DATA_HEADER_SIZE is reserved and zero.
DATA_HEADER_STRUCT = "<8sHHI16s"
DATA_HEADER_FIELDS_SIZE = 32            # struct.calcsize(DATA_HEADER_STRUCT)
ARTIFACT_ID_BYTES = 16                  # written as 32 lowercase hex digits in the manifest
CHUNK_ALIGNMENT = 4096
TENSOR_ALIGNMENT = 64

# Caps a reader enforces before it trusts a manifest.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_RANK = 8
MAX_TENSORS = 1_000_000
MAX_CHUNKS = 1_000_000
MAX_FILES = 100_000
MAX_NAME_LEN = 1024
MAX_CHUNK_DECODED = 64 * 1024**3
MAX_FRAME_SIZE = 64 * 1024 * 1024
MAX_DIM = 1 << 40                       # largest dimension of a tensor's shape
MAX_MANIFEST_INT = 1 << 62              # largest integer a size, offset or count may hold
# A manifest holds at most one JSON object or array per this many bytes of its text (plus a
# few): checked before parsing, so that parsing memory stays a small multiple of the text.
MANIFEST_BYTES_PER_CONTAINER = 24
MANIFEST_CONTAINER_SLACK = 64

# Codec ids.
CODEC_RAW = "raw"
CODEC_ZSTD = "zstd"
CODEC_PLANES = "planes"

CHECKSUM_ALGO = "xxh3_64"
CHECKSUM_HEX_DIGITS = 16                # a checksum is CHECKSUM_ALGO + ":" + 16 hex digits

# Writer defaults (chosen from docs/BENCHMARKS.md, bench_format).
DEFAULT_LEVEL = 1
ZSTD_LEVELS = (-7, 22)                  # the zstd levels a chunk may be written with
DEFAULT_FRAME_SIZE = 1024 * 1024
DEFAULT_BLOCKSIZE = 64
DEFAULT_MAX_FILE_SIZE = 4 * 1024**3

# Tensor encodings and roles.
ENCODING_PLAIN = "plain"
ENCODING_NF4 = "nf4"
ENCODING_INT8 = "int8"      # int8 codes, one float32 scale per row (FORMAT.md 2.2)
# llama.cpp's Q8_0 blocks: per 32 values a float16 scale and 32 int8 codes (lct/format/q8_0.py).
ENCODING_Q8_0 = "q8_0"      # since 1.3
Q8_0_BLOCK = 32
Q8_0_BLOCK_BYTES = 34
ENCODING_Q6_K = "q6_k"      # since 1.4
# llama.cpp's Q6_K blocks: per 256 values 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8
# scales (one per sub-block of 16 values) and a float16 scale (lct/format/q6_k.py).
Q6_K_BLOCK = 256
Q6_K_BLOCK_BYTES = 210
Q6_K_SUB_BLOCK = 16
Q6_K_GROUP_MAX_EPS = 1e-15  # as float32: a sub-block or block under it is all zero
# int8 codes with one float32 scale per block of 128 values of a row (int8's rule, per block:
# lct/format/int8.py), the scales after the codes as int8's are (FORMAT.md 2.2).
ENCODING_INT8_B128 = "int8_b128"  # since 1.5
INT8_BLOCK = 128
ROLES = ("embed", "head", "pos_embed", "layer", "norm", "misc")
# The roles a lossy encoding may be chosen for, and the encodings a policy may give them.
LOSSY_ROLES = ("embed", "head")
INT8_MAX = 127

# Groups.
GROUP_EMBED = "embed"
GROUP_NORM = "norm"
GROUP_HEAD = "head"
GROUP_MISC = "misc"
GROUP_LAYER_PREFIX = "layers."
GROUP_EXPERTS_SUFFIX = ".experts"       # a block's routed experts: group "layers.N.experts"
EXPERTS_MODULE = "experts"      # the module name transformers gives a layer's routed experts
# A routed-expert group's chunks (FORMAT.md section 4): whole experts, at most this many bytes
# (an expert larger than it spans chunks, split between its tensors) ...
EXPERT_CHUNK_BYTES = 256 << 20
# ... and at most ceil(experts / EXPERT_CHUNKS) experts, so that each of up to this many
# expert-parallel ranks reads only chunks that hold its own experts.
EXPERT_CHUNKS = 8

# dtype name -> element size in bytes.
DTYPE_SIZES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")
CAST_TARGETS = ("float16", "bfloat16")

# The NF4 code table of bitsandbytes (index = 4-bit code); code 7 is exactly 0.
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
NF4_ZERO_CODE = 7
# An NF4 blocksize is even, in 2..NF4_MAX_BLOCKSIZE, and divides the row length (FORMAT.md 2.2).
NF4_MIN_BLOCKSIZE = 2
NF4_MAX_BLOCKSIZE = 1 << 20

# Maximus: frequency-ordered vocabulary shards.
ROW_ORDER_MAXIMUS = "maximus"
MAXIMUS_FILE = "maximus.safetensors"
MAXIMUS_STATE_FORMAT = "lct-maximus"     # the state file's metadata "format" and "version"
MAXIMUS_STATE_VERSION = "1"
DEFAULT_MAXIMUS_SHARDS = 32
MAX_TP_PIECES = 1024       # tensor-parallel pieces a tensor may be split into by the converter
# The counters of the state file's ``stats`` tensor, in order (FORMAT.md section 9).
MAXIMUS_STATS_FIELDS = ("lookups", "hits", "misses", "shard_loads", "shard_evictions",
                        "bytes_moved", "steps", "pad_lookups")
# MaximusEmbedding's shard policy unless told otherwise (docs/FORMAT.md section 9).
DEFAULT_MAXIMUS_POLICY = {"load_rate": 0.3, "evict_rate": 0.05, "decay": 0.9, "bucket_size": 1,
                          "sparse": True}

# Side files: every top-level regular file of the source that is not weights, an index of
# weights, the model card or git metadata is copied next to the weights (FORMAT.md section 1),
# named like this, up to these sizes; the ones listed in SIDECAR_FILES are the well-known ones.
SIDE_FILE_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".gguf",
                   ".h5", ".msgpack", ".onnx", ".npz", ".npy", ".ot", ".tflite", ".lct")
NOT_SIDE_FILES = ("README.md", ".gitattributes", MANIFEST_NAME)
MAX_SIDE_FILE_BYTES = 64 * 1024 * 1024
MAX_SIDE_FILES_BYTES = 512 * 1024 * 1024

# Files copied from the source next to the weights.
SIDECAR_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",          # transformers 4.43+ saves a chat model's template here
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
)

# Side files that decide what model a load builds: checked against the manifest on every open.
MODEL_SIDE_FILES = ("config.json", "generation_config.json")

# What `lct export` leaves in the folder it writes (the artifact it came from, the writer): the
# mark by which a later export --force knows the folder is LCT's to replace.
EXPORT_MARKER = ".lct-export.json"

# Largest safetensors shard `lct export` writes: save_pretrained's default in transformers 5
# ("50GB"; 4.x used "5GB").
EXPORT_SHARD_SIZE = "50GB"

# Rows of a quantized LM head dequantized at a time on its chunked path are capped by this many
# bytes of dequantized weight (kernels/linear.py; the planner models the same chunk). Which CPU
# path a head takes (fused, tiled, chunked) is measured at run time (kernels/paths.py).
NF4_HEAD_CHUNK_BYTES = 128 << 20
