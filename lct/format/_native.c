/* lct.format._native: the format's inner loops that Python can only do in several passes, or
 * only while holding the GIL between every frame (the fused matmuls over these encodings are the
 * kernels', kernels/_native.c).
 *
 *   join_planes(hi, lo, out, width)   planes codec decode (FORMAT.md 5): one pass from the
 *                                     exponent plane and the sign/mantissa plane to the elements.
 *   decode_frames(stored, out, table, width)
 *                                     a run of a chunk's frames (zstd, or planes when width is
 *                                     2 or 4) decoded with the GIL released for the whole run,
 *                                     through the system's libzstd (loaded with dlopen).
 *   zstd_available()                  whether libzstd was found; when it is not, decode_frames
 *                                     refuses and Python decodes each frame.
 *   nf4_quantize(x, kind, mids, packed, absmax, blocksize)
 *                                     NF4 from float32 (kind 0) or bfloat16 (kind 1), byte-
 *                                     identical to bitsandbytes' CPU quantize_4bit
 *                                     (lct/format/nf4.py).
 *   nf4_dequant(packed, absmax, code, out, blocksize, kind)
 *                                     NF4 to float32 (kind 0) or bfloat16 (kind 1), bit-identical
 *                                     to bitsandbytes' dequantize_4bit and torch's float->bf16
 *                                     cast.
 *   q8_0_quantize(x, kind, out)       llama.cpp's Q8_0 from float32 (kind 0) or bfloat16 (kind 1):
 *                                     per 32 elements 34 bytes, a little-endian float16 d and 32
 *                                     int8 q, byte-identical to ggml's quantize_row_q8_0_ref (the
 *                                     gguf package's Q8_0.quantize_blocks).
 *   q8_0_dequant(blocks, out, kind)   Q8_0 to float32 (kind 0) or bfloat16 (kind 1), q * d,
 *                                     bit-identical to gguf's dequantize and torch's float->bf16
 *                                     cast.
 *   q6_k_quantize(x, kind, out, threads, isa)
 *                                     llama.cpp's Q6_K from float32 (kind 0) or bfloat16 (kind 1):
 *                                     per 256 elements 210 bytes, byte-identical to ggml's
 *                                     quantize_row_q6_K_ref; blocks split over `threads` threads.
 *   q6_k_dequant(blocks, out, kind, threads)
 *                                     Q6_K to float32 (kind 0) or bfloat16 (kind 1), d * scale *
 *                                     (q - 32), bit-identical to gguf's dequantize.
 *   int8_quantize(x, kind, q, scale, cols, threads, isa)
 *                                     int8 per row (FORMAT.md 2.2) from float32, bfloat16, float16
 *                                     or float64 (kind 0..3): scale = max|x| / 127, q =
 *                                     round_half_even(x / scale), bit for bit the torch rule of
 *                                     lct/format/int8.py; rows split over `threads` threads.
 *   int8_dequant(q, scale, out, kind, cols, threads, isa)
 *                                     int8 rows to float32, bfloat16 or float16 (kind 0..2),
 *                                     q * scale, bit-identical to torch's casts of it.
 *   codec_isa()                       the widest instruction set the threaded codecs (Q6_K,
 *                                     int8) use here.
 *
 * Each takes buffer-protocol objects, checks every length before touching memory, and releases
 * the GIL while it runs, so that decode threads work in parallel. lct/format/native.py wraps them
 * and falls back to numpy/torch when this module was not built or LCT_NATIVE=0.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lct_f16.h"

static void join16(const uint8_t *hi, const uint8_t *lo, uint16_t *out, Py_ssize_t n)
{
    /* y = hi << 8 | lo is rotl(x, 1); x = rotr(y, 1). */
    for (Py_ssize_t i = 0; i < n; i++) {
        uint16_t l = lo[i];
        out[i] = (uint16_t)(((uint16_t)hi[i] << 7) | (l >> 1) | (uint16_t)(l << 15));
    }
}

static void join32(const uint8_t *hi, const uint8_t *lo, uint32_t *out, Py_ssize_t n)
{
    /* lo holds the three low bytes of y (little-endian order), hi its top byte. */
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *l = lo + 3 * i;
        uint32_t y = (uint32_t)l[0] | ((uint32_t)l[1] << 8) | ((uint32_t)l[2] << 16)
                     | ((uint32_t)hi[i] << 24);
        out[i] = (y >> 1) | (y << 31);
    }
}

static PyObject *join_planes(PyObject *self, PyObject *args)
{
    Py_buffer hi, lo, out;
    int width;
    if (!PyArg_ParseTuple(args, "y*y*w*i", &hi, &lo, &out, &width))
        return NULL;
    PyObject *ret = NULL;
    Py_ssize_t n = hi.len;
    if (width != 2 && width != 4) {
        PyErr_Format(PyExc_ValueError, "join_planes: width must be 2 or 4, got %d", width);
    } else if (lo.len != n * (width - 1) || out.len != n * width) {
        PyErr_Format(PyExc_ValueError,
                     "join_planes: %zd exponent bytes need %zd mantissa bytes and a %zd-byte "
                     "output, got %zd and %zd", n, n * (width - 1), n * width, lo.len, out.len);
    } else if (((uintptr_t)out.buf) % width) {
        PyErr_SetString(PyExc_ValueError, "join_planes: output buffer is not aligned");
    } else {
        Py_BEGIN_ALLOW_THREADS
        if (width == 2)
            join16(hi.buf, lo.buf, out.buf, n);
        else
            join32(hi.buf, lo.buf, out.buf, n);
        Py_END_ALLOW_THREADS
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&hi);
    PyBuffer_Release(&lo);
    PyBuffer_Release(&out);
    return ret;
}

/* libzstd's stable API, declared here and resolved at run time (no header needed to build). */
typedef struct ZSTD_DCtx_s ZSTD_DCtx;
static ZSTD_DCtx *(*zstd_create)(void);
static size_t (*zstd_free)(ZSTD_DCtx *);
static size_t (*zstd_decompress)(ZSTD_DCtx *, void *, size_t, const void *, size_t);
static unsigned (*zstd_is_error)(size_t);
static const char *(*zstd_error_name)(size_t);
static unsigned long long (*zstd_content_size)(const void *, size_t);
static size_t (*zstd_frame_size)(const void *, size_t);
static int zstd_state = -1;  /* -1 not tried, 0 absent, 1 loaded */
#define ZSTD_CONTENTSIZE_UNKNOWN (0ULL - 1)
#define ZSTD_CONTENTSIZE_ERROR (0ULL - 2)

static int load_zstd(void)
{
    /* Called with the GIL held (decode_frames resolves before releasing it), so once. */
    if (zstd_state >= 0)
        return zstd_state;
    const char *names[] = {"libzstd.so.1", "libzstd.so", NULL};
    for (int i = 0; names[i]; i++) {
        void *h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (!h)
            continue;
        *(void **)&zstd_create = dlsym(h, "ZSTD_createDCtx");
        *(void **)&zstd_free = dlsym(h, "ZSTD_freeDCtx");
        *(void **)&zstd_decompress = dlsym(h, "ZSTD_decompressDCtx");
        *(void **)&zstd_is_error = dlsym(h, "ZSTD_isError");
        *(void **)&zstd_error_name = dlsym(h, "ZSTD_getErrorName");
        *(void **)&zstd_content_size = dlsym(h, "ZSTD_getFrameContentSize");
        *(void **)&zstd_frame_size = dlsym(h, "ZSTD_findFrameCompressedSize");
        if (zstd_create && zstd_free && zstd_decompress && zstd_is_error && zstd_error_name
            && zstd_content_size && zstd_frame_size) {
            zstd_state = 1;
            return 1;
        }
        dlclose(h);  /* a library without the stable API: try the next name */
    }
    zstd_state = 0;
    return 0;
}

static PyObject *zstd_available(PyObject *self, PyObject *args)
{
    return PyBool_FromLong(load_zstd());
}

/* Decompress exactly `n` bytes into dst; 0 on success, else an error message in err. */
static int unzstd(ZSTD_DCtx *d, uint8_t *dst, size_t n, const uint8_t *src, size_t len,
                  char *err, size_t errlen)
{
    unsigned long long declared = zstd_content_size(src, len);
    if (declared == ZSTD_CONTENTSIZE_UNKNOWN || declared == ZSTD_CONTENTSIZE_ERROR) {
        snprintf(err, errlen, "zstd frame declares %s, expected %zu bytes",
                 declared == ZSTD_CONTENTSIZE_ERROR ? "nothing readable (not a zstd frame)"
                                                   : "no content size", n);
        return -1;
    }
    if (declared != (unsigned long long)n) {
        snprintf(err, errlen, "zstd frame declares %llu bytes, expected %zu", declared, n);
        return -1;
    }
    size_t frame = zstd_frame_size(src, len);
    if (zstd_is_error(frame) || frame != len) {
        /* One frame, nothing after it (as python-zstandard's allow_extra_data=False). */
        snprintf(err, errlen, "zstd error: %s",
                 zstd_is_error(frame) ? zstd_error_name(frame) : "data after the frame");
        return -1;
    }
    size_t got = zstd_decompress(d, dst, n, src, len);
    if (zstd_is_error(got)) {
        snprintf(err, errlen, "zstd error: %s", zstd_error_name(got));
        return -1;
    }
    if (got != n) {
        snprintf(err, errlen, "decoded %zu bytes, expected %zu", got, n);
        return -1;
    }
    return 0;
}

/* One table row per frame: start (output byte), n (elements; bytes when width is 0), at
 * (stored offset), hi_len, lo_len, mode (planes: 1 if the lo plane is zstd). */
static PyObject *decode_frames(PyObject *self, PyObject *args)
{
    Py_buffer stored, out, table;
    int width;
    if (!PyArg_ParseTuple(args, "y*w*y*i", &stored, &out, &table, &width))
        return NULL;
    PyObject *ret = NULL;
    char err[200] = "";
    Py_ssize_t bad = -1;
    Py_ssize_t rows = table.len / (6 * 8);
    int64_t *t = NULL;  /* a private copy: the caller's array could change under us */
    if (!load_zstd()) {
        PyErr_SetString(PyExc_RuntimeError, "decode_frames: libzstd is not available");
    } else if (width != 0 && width != 2 && width != 4) {
        PyErr_Format(PyExc_ValueError, "decode_frames: width must be 0, 2 or 4, got %d", width);
    } else if (table.len % (6 * 8) || ((uintptr_t)table.buf) % 8 || ((uintptr_t)out.buf) % 4) {
        PyErr_SetString(PyExc_ValueError, "decode_frames: bad table or unaligned output");
    } else if (rows && !(t = malloc((size_t)table.len))) {
        PyErr_NoMemory();
    } else {
        if (rows)
            memcpy(t, table.buf, (size_t)table.len);
        /* Check every row against the buffers before any decoding. */
        size_t scratch = 0;
        Py_ssize_t w = width ? width : 1;
        for (Py_ssize_t i = 0; i < rows && bad < 0; i++) {
            const int64_t *r = t + 6 * i;
            int64_t start = r[0], n = r[1], at = r[2], hl = r[3], ll = r[4], mode = r[5];
            if (start < 0 || n < 0 || at < 0 || hl < 0 || ll < 0 || (mode != 0 && mode != 1)
                || n > out.len / w || start > out.len - n * w
                || hl > stored.len || at > stored.len - hl || ll > stored.len - hl - at
                || (width && mode == 0 && ll != n * (width - 1)) || (!width && (ll || mode))
                || (start % w)) {
                bad = i;
                snprintf(err, sizeof err, "frame table row does not fit the chunk");
            }
            if (width && (size_t)(n * width) > scratch)
                scratch = (size_t)(n * width);
        }
        if (bad < 0) {
            uint8_t *buf = malloc(scratch ? scratch : 1);
            ZSTD_DCtx *d = zstd_create();
            if (!buf || !d) {
                free(buf);
                if (d)
                    zstd_free(d);
                PyErr_NoMemory();
                goto done;
            }
            Py_BEGIN_ALLOW_THREADS
            const uint8_t *src = stored.buf;
            uint8_t *dst = out.buf;
            for (Py_ssize_t i = 0; i < rows; i++) {
                const int64_t *r = t + 6 * i;
                size_t start = r[0], n = r[1], at = r[2], hl = r[3], ll = r[4];
                int mode = (int)r[5];
                if (!width) {
                    if (unzstd(d, dst + start, n, src + at, hl, err, sizeof err)) {
                        bad = i;
                        break;
                    }
                    continue;
                }
                uint8_t *hi = buf, *lo = (uint8_t *)src + at + hl;
                if (unzstd(d, hi, n, src + at, hl, err, sizeof err)) {
                    bad = i;
                    break;
                }
                if (mode == 1) {
                    lo = buf + n;
                    if (unzstd(d, lo, n * (width - 1), src + at + hl, ll, err, sizeof err)) {
                        bad = i;
                        break;
                    }
                }
                if (width == 2)
                    join16(hi, lo, (uint16_t *)(dst + start), n);
                else
                    join32(hi, lo, (uint32_t *)(dst + start), n);
            }
            Py_END_ALLOW_THREADS
            free(buf);
            zstd_free(d);
        }
        if (bad >= 0)
            ret = Py_BuildValue("(ns)", bad, err);
        else
            ret = Py_NewRef(Py_None);
    }
done:
    free(t);
    PyBuffer_Release(&stored);
    PyBuffer_Release(&out);
    PyBuffer_Release(&table);
    return ret;
}

static inline uint16_t to_bf16(float f)
{
    /* torch's c10::BFloat16 rounding: nearest-even, NaN to the canonical quiet NaN. */
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f)
        return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static void dequant(const uint8_t *restrict packed, const float *restrict absmax,
                    const float *restrict code, void *restrict out, Py_ssize_t n,
                    Py_ssize_t blocksize, int kind)
{
    float vals[16];
    uint16_t b16[16];
    for (Py_ssize_t e0 = 0, b = 0; e0 < n; e0 += blocksize, b++) {
        Py_ssize_t e1 = e0 + blocksize < n ? e0 + blocksize : n;
        float a = absmax[b];
        for (int k = 0; k < 16; k++) {
            vals[k] = code[k] * a;
            b16[k] = to_bf16(vals[k]);
        }
        const uint8_t *restrict p = packed + e0 / 2;  /* blocksize is even: no byte spans blocks */
        Py_ssize_t pairs = (e1 - e0) / 2;
        if (kind == 0) {
            float *restrict o = (float *)out + e0;
            for (Py_ssize_t j = 0; j < pairs; j++) {
                uint8_t v = p[j];
                o[2 * j] = vals[v >> 4];
                o[2 * j + 1] = vals[v & 15];
            }
            if ((e1 - e0) & 1)
                o[2 * pairs] = vals[p[pairs] >> 4];
        } else {
            uint16_t *o = (uint16_t *)out + e0;
            /* Both elements of a byte in one 32-bit store (little-endian: first element low). */
            uint32_t *restrict o32 = (uint32_t *)o;
            if (((uintptr_t)o) % 4 == 0) {
                for (Py_ssize_t j = 0; j < pairs; j++) {
                    uint8_t v = p[j];
                    o32[j] = (uint32_t)b16[v >> 4] | ((uint32_t)b16[v & 15] << 16);
                }
            } else {
                for (Py_ssize_t j = 0; j < pairs; j++) {
                    uint8_t v = p[j];
                    o[2 * j] = b16[v >> 4];
                    o[2 * j + 1] = b16[v & 15];
                }
            }
            if ((e1 - e0) & 1)
                o[2 * pairs] = b16[p[pairs] >> 4];
        }
    }
}

/* The checks nf4_dequant and nf4_quantize share: the kind, the blocksize, and the packed and
 * absmax sizes for `elem_bytes` bytes of elements. Returns the element count, or -1 with a
 * ValueError set. */
static Py_ssize_t nf4_layout(const char *fn, int kind, Py_ssize_t blocksize,
                             Py_ssize_t elem_bytes, Py_ssize_t packed_len, Py_ssize_t absmax_len)
{
    if (kind != 0 && kind != 1) {
        PyErr_Format(PyExc_ValueError, "%s: kind must be 0 (float32) or 1 (bfloat16)", fn);
        return -1;
    }
    if (blocksize <= 0 || blocksize % 2) {
        PyErr_Format(PyExc_ValueError, "%s: blocksize %zd must be positive and even", fn,
                     blocksize);
        return -1;
    }
    Py_ssize_t size = kind == 0 ? 4 : 2, n = elem_bytes / size;
    Py_ssize_t blocks = n / blocksize + (n % blocksize != 0);
    if (elem_bytes % size || packed_len != (n + 1) / 2 || absmax_len != blocks * 4) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %zd elements need %zd packed bytes and %zd absmax bytes, got %zd and %zd",
                     fn, n, (n + 1) / 2, blocks * 4, packed_len, absmax_len);
        return -1;
    }
    return n;
}

static PyObject *nf4_dequant(PyObject *self, PyObject *args)
{
    Py_buffer packed, absmax, code, out;
    Py_ssize_t blocksize;
    int kind;
    if (!PyArg_ParseTuple(args, "y*y*y*w*ni", &packed, &absmax, &code, &out, &blocksize, &kind))
        return NULL;
    PyObject *ret = NULL;
    Py_ssize_t size = kind == 0 ? 4 : 2;
    Py_ssize_t n = nf4_layout("nf4_dequant", kind, blocksize, out.len, packed.len, absmax.len);
    if (n < 0) {
        /* error set */
    } else if (code.len != 16 * 4) {
        PyErr_Format(PyExc_ValueError, "nf4_dequant: the code table is %zd bytes, expected 64",
                     code.len);
    } else if (((uintptr_t)out.buf) % size || ((uintptr_t)absmax.buf) % 4
               || ((uintptr_t)code.buf) % 4) {
        PyErr_SetString(PyExc_ValueError, "nf4_dequant: a buffer is not aligned");
    } else {
        Py_BEGIN_ALLOW_THREADS
        dequant(packed.buf, absmax.buf, code.buf, out.buf, n, blocksize, kind);
        Py_END_ALLOW_THREADS
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&packed);
    PyBuffer_Release(&absmax);
    PyBuffer_Release(&code);
    PyBuffer_Release(&out);
    return ret;
}

/* The rule of lct/format/nf4.py: absmax per block in float32, scale by the float32 reciprocal,
 * code = number of the 15 float32 midpoints strictly below the scaled value, all-zero block ->
 * code 7, first element of a pair in the high nibble, an odd tail padded with code 7. Each pass
 * is a plain loop over one block so that the compiler vectorises it. `v` and `c` hold blocksize + 1
 * elements. Returns the first block holding a NaN or an Inf, or -1. */
static Py_ssize_t quantize(const void *x, int kind, const float *mids, uint8_t *packed,
                           float *absmax, Py_ssize_t n, Py_ssize_t blocksize, float *v,
                           int32_t *c)
{
    for (Py_ssize_t e0 = 0, b = 0; e0 < n; e0 += blocksize, b++) {
        Py_ssize_t len = e0 + blocksize < n ? blocksize : n - e0;
        if (kind == 0) {
            memcpy(v, (const float *)x + e0, (size_t)len * 4);
        } else {
            const uint16_t *h = (const uint16_t *)x + e0;
            uint32_t *u = (uint32_t *)v;
            for (Py_ssize_t i = 0; i < len; i++)
                u[i] = (uint32_t)h[i] << 16;
        }
        float am = 0.0f;
        int bad = 0;
        for (Py_ssize_t i = 0; i < len; i++) {
            float a = fabsf(v[i]);
            bad |= !(a <= FLT_MAX);
            am = a > am ? a : am;
        }
        if (bad)
            return b;
        absmax[b] = am;
        float inv = 1.0f / am;
        for (Py_ssize_t i = 0; i < len; i++) {
            v[i] = v[i] * inv;
            c[i] = 0;
        }
        for (int m = 0; m < 15; m++) {
            float mid = mids[m];
            for (Py_ssize_t i = 0; i < len; i++)
                c[i] += mid < v[i];
        }
        if (am == 0.0f)
            for (Py_ssize_t i = 0; i < len; i++)
                c[i] = 7;
        c[len] = 7;  /* the pad of an odd tail */
        uint8_t *p = packed + e0 / 2;
        for (Py_ssize_t i = 0; 2 * i < len; i++)
            p[i] = (uint8_t)((c[2 * i] << 4) | c[2 * i + 1]);
    }
    return -1;
}

static PyObject *nf4_quantize(PyObject *self, PyObject *args)
{
    Py_buffer x, mids, packed, absmax;
    int kind;
    Py_ssize_t blocksize;
    if (!PyArg_ParseTuple(args, "y*iy*w*w*n", &x, &kind, &mids, &packed, &absmax, &blocksize))
        return NULL;
    PyObject *ret = NULL;
    Py_ssize_t size = kind == 0 ? 4 : 2;
    Py_ssize_t n = nf4_layout("nf4_quantize", kind, blocksize, x.len, packed.len, absmax.len);
    if (n < 0) {
        /* error set */
    } else if (mids.len != 15 * 4) {
        PyErr_Format(PyExc_ValueError, "nf4_quantize: %zd midpoint bytes, expected 60", mids.len);
    } else if (((uintptr_t)x.buf) % size || ((uintptr_t)absmax.buf) % 4
               || ((uintptr_t)mids.buf) % 4) {
        PyErr_SetString(PyExc_ValueError, "nf4_quantize: a buffer is not aligned");
    } else {
        size_t room = (size_t)(blocksize < n ? blocksize : n) + 1;  /* one block, plus the pad */
        float *v = malloc(room * sizeof(float));
        int32_t *c = malloc(room * sizeof(int32_t));
        if (!v || !c) {
            free(v);
            free(c);
            PyErr_NoMemory();
        } else {
            Py_ssize_t bad;
            Py_BEGIN_ALLOW_THREADS
            bad = quantize(x.buf, kind, mids.buf, packed.buf, absmax.buf, n, blocksize, v, c);
            Py_END_ALLOW_THREADS
            free(v);
            free(c);
            ret = PyLong_FromSsize_t(bad);
        }
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&mids);
    PyBuffer_Release(&packed);
    PyBuffer_Release(&absmax);
    return ret;
}

/* ---- Q8_0 (llama.cpp): per block of 32 elements, float16 d = amax / 127 and int8 q ----------- */
#define Q8_BLOCK 32
#define Q8_BLOCK_BYTES 34

/* float32 -> float16 bits, round to nearest even (as numpy's astype(np.float16)): overflow to
 * Inf, subnormals rounded, NaN kept quiet with its top payload bits. */
static uint16_t to_f16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7FFFFFFFu, e = a >> 23;
    if (a >= 0x7F800000u)  /* Inf, NaN */
        return sign | 0x7C00u | (a > 0x7F800000u ? (uint16_t)(0x0200u | ((a >> 13) & 0x3FFu)) : 0);
    if (a >= 0x477FF000u)  /* from halfway above 65504 (to even: up) */
        return sign | 0x7C00u;
    if (e >= 113) {  /* normal: 2^-14 and up */
        uint32_t h = ((e - 112) << 10) | ((a >> 13) & 0x3FFu), rem = a & 0x1FFFu;
        h += rem > 0x1000u || (rem == 0x1000u && (h & 1));  /* a carry steps the exponent */
        return sign | (uint16_t)h;
    }
    if (e < 102)  /* below 2^-25, half the smallest subnormal (2^-25 itself is a tie: to 0) */
        return sign;
    uint32_t mant = (a & 0x7FFFFFu) | 0x800000u, shift = 126 - e;  /* 14..24 */
    uint32_t h = mant >> shift, rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    h += rem > half || (rem == half && (h & 1));  /* may reach 0x400, the smallest normal */
    return sign | (uint16_t)h;
}


/* ggml's rule (quantize_row_q8_0_ref): amax = max |x|, d = amax / 127, id = d ? 1 / d : 0,
 * q = roundf(x * id) (half away from zero), all in float32, d stored as float16. A product that
 * is not a number below 2^31 (id overflowed to Inf for a d under 2^-128) gives code 0, as
 * numpy's float->int8 cast does on x86 (the C cast's result is undefined there). Returns the
 * first block holding a NaN or an Inf, or -1; blocks before it are written. */
static Py_ssize_t q8_quantize(const void *x, int kind, uint8_t *out, Py_ssize_t blocks)
{
    float v[Q8_BLOCK];
    for (Py_ssize_t b = 0; b < blocks; b++) {
        if (kind == 0) {
            memcpy(v, (const float *)x + b * Q8_BLOCK, sizeof v);
        } else {
            const uint16_t *h = (const uint16_t *)x + b * Q8_BLOCK;
            uint32_t u[Q8_BLOCK];
            for (int i = 0; i < Q8_BLOCK; i++)
                u[i] = (uint32_t)h[i] << 16;
            memcpy(v, u, sizeof v);
        }
        float amax = 0.0f;
        int bad = 0;
        for (int i = 0; i < Q8_BLOCK; i++) {
            float a = fabsf(v[i]);
            bad |= !(a <= FLT_MAX);
            amax = a > amax ? a : amax;
        }
        if (bad)
            return b;
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint8_t *blk = out + b * Q8_BLOCK_BYTES;
        uint16_t dh = to_f16(d);
        blk[0] = (uint8_t)(dh & 0xFF);
        blk[1] = (uint8_t)(dh >> 8);
        for (int i = 0; i < Q8_BLOCK; i++) {
            float y = v[i] * id;
            int32_t q = fabsf(y) < 2147483648.0f ? (int32_t)roundf(y) : INT32_MIN;
            blk[2 + i] = (uint8_t)q;  /* the low byte: numpy's wrap of an out-of-range code */
        }
    }
    return -1;
}

static void q8_dequant(const uint8_t *restrict in, void *restrict out, Py_ssize_t blocks,
                       int kind)
{
    for (Py_ssize_t b = 0; b < blocks; b++) {
        const uint8_t *blk = in + b * Q8_BLOCK_BYTES;
        const int8_t *q = (const int8_t *)(blk + 2);
        float d = f16_to_f32((uint16_t)(blk[0] | (blk[1] << 8)));
        if (kind == 0) {
            float *restrict o = (float *)out + b * Q8_BLOCK;
            for (int i = 0; i < Q8_BLOCK; i++)
                o[i] = (float)q[i] * d;
        } else {
            uint16_t *restrict o = (uint16_t *)out + b * Q8_BLOCK;
            for (int i = 0; i < Q8_BLOCK; i++)
                o[i] = to_bf16((float)q[i] * d);
        }
    }
}

/* The checks a block codec's quantize and dequantize share (Q8_0's, Q6_K's): the kind, whole
 * blocks of ``qk`` elements, and ``block_bytes`` bytes of blocks per block. Returns the block
 * count, or -1 with a ValueError set. */
static Py_ssize_t block_layout(const char *fn, int kind, Py_ssize_t elem_bytes,
                               Py_ssize_t block_len, int qk, Py_ssize_t block_bytes)
{
    if (kind != 0 && kind != 1) {
        PyErr_Format(PyExc_ValueError, "%s: kind must be 0 (float32) or 1 (bfloat16)", fn);
        return -1;
    }
    Py_ssize_t size = kind == 0 ? 4 : 2, n = elem_bytes / size, blocks = n / qk;
    if (elem_bytes % size || n % qk) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes of elements are not whole blocks of %d "
                     "%s elements", fn, elem_bytes, qk, kind == 0 ? "float32" : "bfloat16");
        return -1;
    }
    if (block_len / block_bytes != blocks || block_len % block_bytes) {
        PyErr_Format(PyExc_ValueError, "%s: %zd elements need %zd bytes of blocks, got %zd", fn,
                     n, blocks * block_bytes, block_len);
        return -1;
    }
    return blocks;
}

static Py_ssize_t q8_layout(const char *fn, int kind, Py_ssize_t elem_bytes, Py_ssize_t block_len)
{
    return block_layout(fn, kind, elem_bytes, block_len, Q8_BLOCK, Q8_BLOCK_BYTES);
}

static PyObject *q8_0_quantize(PyObject *self, PyObject *args)
{
    Py_buffer x, out;
    int kind;
    if (!PyArg_ParseTuple(args, "y*iw*", &x, &kind, &out))
        return NULL;
    PyObject *ret = NULL;
    Py_ssize_t blocks = q8_layout("q8_0_quantize", kind, x.len, out.len);
    if (blocks < 0) {
        /* error set */
    } else if (((uintptr_t)x.buf) % (kind == 0 ? 4 : 2)) {
        PyErr_SetString(PyExc_ValueError, "q8_0_quantize: the input buffer is not aligned");
    } else {
        Py_ssize_t bad;
        Py_BEGIN_ALLOW_THREADS
        bad = q8_quantize(x.buf, kind, out.buf, blocks);
        Py_END_ALLOW_THREADS
        ret = PyLong_FromSsize_t(bad);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    return ret;
}

static PyObject *q8_0_dequant(PyObject *self, PyObject *args)
{
    Py_buffer blocks, out;
    int kind;
    if (!PyArg_ParseTuple(args, "y*w*i", &blocks, &out, &kind))
        return NULL;
    PyObject *ret = NULL;
    Py_ssize_t nb = q8_layout("q8_0_dequant", kind, out.len, blocks.len);
    if (nb < 0) {
        /* error set */
    } else if (((uintptr_t)out.buf) % (kind == 0 ? 4 : 2)) {
        PyErr_SetString(PyExc_ValueError, "q8_0_dequant: the output buffer is not aligned");
    } else {
        Py_BEGIN_ALLOW_THREADS
        q8_dequant(blocks.buf, out.buf, nb, kind);
        Py_END_ALLOW_THREADS
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&blocks);
    PyBuffer_Release(&out);
    return ret;
}

/* ---- What the threaded codecs (Q6_K, int8) share: the instruction sets, the thread split ---- */
#if defined(__x86_64__) && defined(__GNUC__)
#define CODEC_X86 1
#endif

/* The instruction sets the threaded codecs can use here: 0 plain C, 1 AVX2 (x86 where the CPU
 * has it). */
static int codec_best_isa(void)
{
#ifdef CODEC_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2"))
        return 1;
#endif
    return 0;
}

/* Run `worker` on each of the `n` jobs (1..64, each `size` bytes from `jobs`): jobs 1.. on threads
 * of their own, job 0 on the calling thread, and a job whose thread cannot start there too. Call
 * without the GIL. */
static void run_jobs(void *(*worker)(void *), void *jobs, size_t size, int n)
{
    pthread_t tids[64];
    char started[64] = {0};
    for (int t = 1; t < n; t++) {
        void *job = (char *)jobs + size * (size_t)t;
        started[t] = pthread_create(&tids[t], NULL, worker, job) == 0;
        if (!started[t])
            worker(job);
    }
    worker(jobs);
    for (int t = 1; t < n; t++)
        if (started[t])
            pthread_join(tids[t], NULL);
}

/* ---- Q6_K (llama.cpp): per 256 elements 210 bytes, 6-bit codes under 16 sub-block scales ----- */
#define Q6_BLOCK 256
#define Q6_BLOCK_BYTES 210
#define Q6_SUB 16
#define Q6_EPS 1e-15f  /* ggml's GROUP_MAX_EPS */

/* The rule needs every float32 product rounded before it is added: no fused multiply-add. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

/* ggml's nearest_int: the low mantissa bits of f + 1.5 * 2^23, so that a float32 add rounds
 * half to even; also defined (a code that is then clamped) for a NaN or a large f. */
static inline __attribute__((always_inline)) int32_t q6_nearest(float f)
{
    float v = f + 12582912.0f;
    int32_t i;
    memcpy(&i, &v, 4);
    return (i & 0x007FFFFF) - 0x00400000;
}

/* 8 float32 or int32 lanes, one per sub-block: GCC's generic vectors, which each target lowers
 * to its own registers (2 SSE or 1 AVX vector; scalars where there are none). */
#define Q6_LANES 8
typedef float q6_vf __attribute__((vector_size(4 * Q6_LANES)));
typedef int32_t q6_vi __attribute__((vector_size(4 * Q6_LANES)));

/* Lanes of a where the mask m is set (-1), else of b (macros: no vector crosses a call). */
#define Q6_SEL(m, a, b) ((q6_vf)(((q6_vi)(a) & (m)) | ((q6_vi)(b) & ~(m))))

/* nearest_int lane by lane, clamped to [-32, 31], as float32 (exact: 1.5 * 2^23 + l has the
 * bits 0x4B400000 + l). */
#define Q6_CODES(out, f)                                                                      \
    do {                                                                                      \
        q6_vf v_ = (f) + 12582912.0f;                                                         \
        q6_vi l_ = ((q6_vi)v_ & 0x007FFFFF) - 0x00400000, lo_ = l_ < -32, hi_ = l_ > 31;      \
        l_ = (l_ & ~lo_) | (lo_ & -32);                                                       \
        l_ = (l_ & ~hi_) | (hi_ & 31);                                                        \
        (out) = (q6_vf)(l_ + 0x4B400000) - 12582912.0f;                                       \
    } while (0)

/* make_qx_quants(16, 32, x, L, 1, NULL) for 8 sub-blocks of 16 values (xb, 128 values) at once,
 * lane k the sub-block k: from the value of largest magnitude `max` (the first such), 19 trial
 * scales -(32 + 0.1 t) / max, t = 0, -9..9, each giving codes l = clamp(nearest(iscale x),
 * -32, 31) and float32 sums, in order, of x^2 x l and x^2 l l (the reference's order in each
 * lane); a trial replaces the kept one when its sumlx^2 > best * suml2. Gives each sub-block's
 * scale (0 when max |x| < EPS: all zero), the kept trial's iscale (its codes are made again
 * from it) and max |x|. */
static inline __attribute__((always_inline)) void
q6_subs(const float *restrict xb, float *restrict scale_out, float *restrict is_out,
        float *restrict amax_out)
{
    q6_vf x[Q6_SUB], w[Q6_SUB], wx[Q6_SUB];  /* [value], lane = sub-block */
    q6_vf amax = {0}, mx = {0};
    for (int i = 0; i < Q6_SUB; i++)
        for (int k = 0; k < Q6_LANES; k++)
            x[i][k] = xb[Q6_SUB * k + i];
    for (int i = 0; i < Q6_SUB; i++) {
        q6_vf a = (q6_vf)((q6_vi)x[i] & 0x7FFFFFFF);
        q6_vi gt = a > amax;
        amax = Q6_SEL(gt, a, amax);
        mx = Q6_SEL(gt, x[i], mx);
        w[i] = x[i] * x[i];
        wx[i] = w[i] * x[i];
    }
    q6_vf scale = {0}, best = {0}, best_is = {0};
    for (int t = 0; t < 19; t++) {
        /* nmax + 0.1f * is in float32, is = -9..-1, 1..9 after the plain trial */
        float nm = t == 0 ? 32.0f : 32.0f + 0.1f * (float)(t <= 9 ? t - 10 : t - 9);
        q6_vf is = -nm / mx, slx = {0}, sl2 = {0};
        for (int i = 0; i < Q6_SUB; i++) {
            q6_vf lf;
            Q6_CODES(lf, is * x[i]);
            q6_vf p = wx[i] * lf, q = w[i] * lf;
            q = q * lf;
            slx = slx + p;
            sl2 = sl2 + q;
        }
        q6_vf s = slx / sl2;
        if (t == 0) {
            scale = Q6_SEL(sl2 != 0.0f, s, scale);
            best = scale * slx;
            best_is = is;
            continue;
        }
        q6_vi take = (sl2 > 0.0f) & (slx * slx > best * sl2);
        scale = Q6_SEL(take, s, scale);
        best = Q6_SEL(take, s * slx, best);
        best_is = Q6_SEL(take, is, best_is);
    }
    scale = Q6_SEL(amax < Q6_EPS, (q6_vf){0}, scale);
    memcpy(scale_out, &scale, sizeof scale);
    memcpy(is_out, &best_is, sizeof best_is);
    memcpy(amax_out, &amax, sizeof amax);
}

/* One block of 256 float32 values to its 210 bytes, ggml's quantize_row_q6_K_ref exactly: the
 * sub-blocks' scales (q6_subs), then d = -max_scale / 128 as float16 (to nearest even) with
 * max_scale the first of largest magnitude (an all-zero block under EPS: 210 zero bytes),
 * scales = min(127, nearest(-128 / max_scale * scale)) as int8, and each sub-block whose
 * float16 d * scale is not 0 coded again as clamp(nearest(x / (d * scale)), -32, 31); one whose
 * product is 0 keeps its own codes. */
static inline __attribute__((always_inline)) void q6_block(const float *restrict xb,
                                                             uint8_t *restrict y)
{
    float scale[Q6_SUB], best_is[Q6_SUB], amax[Q6_SUB];
    for (int g = 0; g < Q6_SUB; g += Q6_LANES)
        q6_subs(xb + Q6_SUB * g, scale + g, best_is + g, amax + g);
    float max_scale = 0.0f, max_abs = 0.0f;
    for (int k = 0; k < Q6_SUB; k++) {
        float a = fabsf(scale[k]);
        if (a > max_abs) {
            max_abs = a;
            max_scale = scale[k];
        }
    }
    if (max_abs < Q6_EPS) {
        memset(y, 0, Q6_BLOCK_BYTES);
        return;
    }
    float iscale = -128.0f / max_scale;
    uint16_t dh = to_f16(1.0f / iscale);
    float df = f16_to_f32(dh);
    int8_t *sc = (int8_t *)(y + 192);
    uint8_t L[Q6_BLOCK];
    for (int k = 0; k < Q6_SUB; k++) {
        int32_t v = q6_nearest(iscale * scale[k]);
        sc[k] = (int8_t)(uint8_t)(v < 127 ? v : 127);  /* ggml's int8 store: the low byte */
        float d = df * (float)sc[k], bk = best_is[k];
        const float *xk = xb + Q6_SUB * k;
        uint8_t *Lk = L + Q6_SUB * k;
        if (d != 0.0f) {
            for (int i = 0; i < Q6_SUB; i++) {
                int32_t l = q6_nearest(xk[i] / d);
                Lk[i] = (uint8_t)((l < -32 ? -32 : l > 31 ? 31 : l) + 32);
            }
        } else if (amax[k] < Q6_EPS) {
            memset(Lk, 0, Q6_SUB);
        } else {  /* the kept trial's codes */
            for (int i = 0; i < Q6_SUB; i++) {
                int32_t l = q6_nearest(bk * xk[i]);
                Lk[i] = (uint8_t)((l < -32 ? -32 : l > 31 ? 31 : l) + 32);
            }
        }
    }
    y[208] = (uint8_t)(dh & 0xFF);
    y[209] = (uint8_t)(dh >> 8);
    /* ql: element e of a half (128) in the low nibble of byte e % 64 (e < 64) or the high
     * nibble (e >= 64); qh: bits 2 * (e / 32) of byte e % 32 hold its top 2 bits. */
    for (int h = 0; h < 2; h++) {
        const uint8_t *Lh = L + 128 * h;
        uint8_t *ql = y + 64 * h, *qh = y + 128 + 32 * h;
        for (int l = 0; l < 32; l++) {
            ql[l] = (uint8_t)((Lh[l] & 0xF) | ((Lh[l + 64] & 0xF) << 4));
            ql[l + 32] = (uint8_t)((Lh[l + 32] & 0xF) | ((Lh[l + 96] & 0xF) << 4));
            qh[l] = (uint8_t)((Lh[l] >> 4) | ((Lh[l + 32] >> 4) << 2) | ((Lh[l + 64] >> 4) << 4)
                              | ((Lh[l + 96] >> 4) << 6));
        }
    }
}

/* Blocks [b0, b1) of x (float32, or bfloat16 bits when kind is 1) into out. Returns the first
 * block holding a NaN or an Inf (nothing written for it or after it), or -1. */
static inline __attribute__((always_inline)) Py_ssize_t
q6_quantize_body(const void *x, int kind, uint8_t *out, Py_ssize_t b0, Py_ssize_t b1)
{
    float v[Q6_BLOCK];
    for (Py_ssize_t b = b0; b < b1; b++) {
        if (kind == 0) {
            memcpy(v, (const float *)x + b * Q6_BLOCK, sizeof v);
        } else {
            const uint16_t *h = (const uint16_t *)x + b * Q6_BLOCK;
            uint32_t u[Q6_BLOCK];
            for (int i = 0; i < Q6_BLOCK; i++)
                u[i] = (uint32_t)h[i] << 16;
            memcpy(v, u, sizeof v);
        }
        int bad = 0;
        for (int i = 0; i < Q6_BLOCK; i++)
            bad |= !(fabsf(v[i]) <= FLT_MAX);
        if (bad)
            return b;
        q6_block(v, out + b * Q6_BLOCK_BYTES);
    }
    return -1;
}

static Py_ssize_t q6_quantize_c(const void *x, int kind, uint8_t *out, Py_ssize_t b0,
                                Py_ssize_t b1)
{
    return q6_quantize_body(x, kind, out, b0, b1);
}

#ifdef CODEC_X86
/* The same body with AVX2: 8 lanes a register (and still no FMA: see above). */
__attribute__((target("avx2"))) static Py_ssize_t
q6_quantize_avx2(const void *x, int kind, uint8_t *out, Py_ssize_t b0, Py_ssize_t b1)
{
    return q6_quantize_body(x, kind, out, b0, b1);
}
#endif

/* Q6_K blocks [b0, b1) to float32 (kind 0) or bfloat16 (kind 1): float32(d) * scale * (q - 32),
 * in that order (ggml's dequantize_row_q6_K), then torch's bfloat16 rounding. */
static void q6_dequant_range(const uint8_t *restrict in, void *restrict out, Py_ssize_t b0,
                             Py_ssize_t b1, int kind)
{
    float v[Q6_BLOCK], ds[Q6_SUB];
    for (Py_ssize_t b = b0; b < b1; b++) {
        const uint8_t *blk = in + b * Q6_BLOCK_BYTES;
        const int8_t *sc = (const int8_t *)(blk + 192);
        float d = f16_to_f32((uint16_t)(blk[208] | (blk[209] << 8)));
        for (int k = 0; k < Q6_SUB; k++)
            ds[k] = d * (float)sc[k];
        /* Element h * 128 + nib * 64 + pair * 32 + l: the nibble `nib` of ql byte h * 64 +
         * pair * 32 + l and bits 2 * (2 * nib + pair) of qh byte h * 32 + l; runs of 16 share
         * a scale. */
        for (int r = 0; r < 4; r++) {
            const int h = r >> 1, l0 = 16 * (r & 1);
            const uint8_t *ql = blk + 64 * h + l0, *qh = blk + 128 + 32 * h + l0;
            float *o = v + 128 * h + l0;
            const float s1 = ds[8 * h + (r & 1)], s2 = ds[8 * h + 2 + (r & 1)];
            const float s3 = ds[8 * h + 4 + (r & 1)], s4 = ds[8 * h + 6 + (r & 1)];
            for (int l = 0; l < 16; l++) {
                int a = ql[l], c = ql[l + 32], e = qh[l];
                o[l] = s1 * (float)(((a & 0xF) | ((e & 3) << 4)) - 32);
                o[l + 32] = s2 * (float)(((c & 0xF) | ((e & 0xC) << 2)) - 32);
                o[l + 64] = s3 * (float)(((a >> 4) | (e & 0x30)) - 32);
                o[l + 96] = s4 * (float)(((c >> 4) | ((e & 0xC0) >> 2)) - 32);
            }
        }
        if (kind == 0) {
            memcpy((float *)out + b * Q6_BLOCK, v, sizeof v);
        } else {
            uint16_t *o = (uint16_t *)out + b * Q6_BLOCK;
            for (int i = 0; i < Q6_BLOCK; i++)
                o[i] = to_bf16(v[i]);
        }
    }
}

#if defined(__clang__)
#pragma STDC FP_CONTRACT ON
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

/* A share of a Q6_K call for one thread: blocks [b0, b1). */
typedef struct {
    const void *in;
    void *out;
    Py_ssize_t b0, b1, bad;
    int kind, isa, quantize;
} q6_job;

static void *q6_worker(void *arg)
{
    q6_job *j = arg;
    if (!j->quantize) {
        q6_dequant_range(j->in, j->out, j->b0, j->b1, j->kind);
        return NULL;
    }
#ifdef CODEC_X86
    if (j->isa == 1) {
        j->bad = q6_quantize_avx2(j->in, j->kind, j->out, j->b0, j->b1);
        return NULL;
    }
#endif
    j->bad = q6_quantize_c(j->in, j->kind, j->out, j->b0, j->b1);
    return NULL;
}

/* Blocks a thread gets at least (a thread start costs some tens of microseconds): about 50 us
 * of quantizing, or of dequantizing. */
#define Q6_QUANTIZE_SHARE 16
#define Q6_DEQUANT_SHARE 256

/* Split `blocks` evenly over `threads` (1..64, fewer when the shares would be small) and run
 * them (run_jobs). Call without the GIL. Returns the first bad block of a quantize, or -1. */
static Py_ssize_t q6_run(const void *in, void *out, Py_ssize_t blocks, int kind, int threads,
                         int isa, int quantize)
{
    q6_job jobs[64];
    Py_ssize_t most = blocks / (quantize ? Q6_QUANTIZE_SHARE : Q6_DEQUANT_SHARE);
    if (threads > 64)
        threads = 64;
    if (threads > most)
        threads = (int)most;
    if (threads < 1)
        threads = 1;
    for (int t = 0; t < threads; t++)
        jobs[t] = (q6_job){in, out, blocks * t / threads, blocks * (t + 1) / threads, -1, kind,
                           isa, quantize};
    run_jobs(q6_worker, jobs, sizeof jobs[0], threads);
    Py_ssize_t bad = -1;
    for (int t = 0; t < threads && bad < 0; t++)
        bad = jobs[t].bad;  /* shares are in block order: the first bad one is the first */
    return bad;
}

static Py_ssize_t q6_layout(const char *fn, int kind, Py_ssize_t elem_bytes, Py_ssize_t block_len)
{
    return block_layout(fn, kind, elem_bytes, block_len, Q6_BLOCK, Q6_BLOCK_BYTES);
}

static PyObject *q6_k_quantize(PyObject *self, PyObject *args)
{
    Py_buffer x, out;
    int kind, threads, isa;
    if (!PyArg_ParseTuple(args, "y*iw*ii", &x, &kind, &out, &threads, &isa))
        return NULL;
    PyObject *ret = NULL;
    Py_ssize_t blocks = q6_layout("q6_k_quantize", kind, x.len, out.len);
    int best = codec_best_isa();
    if (blocks < 0) {
        /* error set */
    } else if (isa < -1 || isa > best) {
        PyErr_Format(PyExc_ValueError, "q6_k_quantize: isa %d is not one this CPU runs "
                     "(-1 for the best, 0..%d)", isa, best);
    } else if (((uintptr_t)x.buf) % (kind == 0 ? 4 : 2)) {
        PyErr_SetString(PyExc_ValueError, "q6_k_quantize: the input buffer is not aligned");
    } else {
        Py_ssize_t bad;
        Py_BEGIN_ALLOW_THREADS
        bad = q6_run(x.buf, out.buf, blocks, kind, threads, isa < 0 ? best : isa, 1);
        Py_END_ALLOW_THREADS
        ret = PyLong_FromSsize_t(bad);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&out);
    return ret;
}

static PyObject *q6_k_dequant(PyObject *self, PyObject *args)
{
    Py_buffer blocks, out;
    int kind, threads;
    if (!PyArg_ParseTuple(args, "y*w*ii", &blocks, &out, &kind, &threads))
        return NULL;
    PyObject *ret = NULL;
    Py_ssize_t nb = q6_layout("q6_k_dequant", kind, out.len, blocks.len);
    if (nb < 0) {
        /* error set */
    } else if (((uintptr_t)out.buf) % (kind == 0 ? 4 : 2)) {
        PyErr_SetString(PyExc_ValueError, "q6_k_dequant: the output buffer is not aligned");
    } else {
        Py_BEGIN_ALLOW_THREADS
        q6_run(blocks.buf, out.buf, nb, kind, threads, 0, 0);
        Py_END_ALLOW_THREADS
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&blocks);
    PyBuffer_Release(&out);
    return ret;
}

static PyObject *codec_isa(PyObject *self, PyObject *args)
{
    return PyLong_FromLong(codec_best_isa());
}

/* ---- int8 per row (FORMAT.md 2.2): one float32 scale a row, one int8 code an element -------- */
#define I8_MAX 127.0f

/* Kinds of the elements int8_quantize reads and int8_dequant writes. */
enum { I8_F32 = 0, I8_BF16 = 1, I8_F16 = 2, I8_F64 = 3 };
static const Py_ssize_t i8_size[4] = {4, 2, 2, 8};
static const char *const i8_name[4] = {"float32", "bfloat16", "float16", "float64"};

/* The rule is torch's, one rounding at a time: no fused multiply-add, a true division. */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif

static inline __attribute__((always_inline)) float i8_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline __attribute__((always_inline)) uint32_t i8_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* Element i of x as float32, as torch's .to(torch.float32): exact from bfloat16 and float16,
 * rounded to nearest even from float64. A finite float16's magnitude bits, moved up 13 places,
 * are a float32 of its value times 2^-112 (a subnormal one too), which an exact multiply by
 * 2^112 restores: no branch, so that the loop vectorises. */
static inline __attribute__((always_inline)) float i8_load(const void *x, int kind, Py_ssize_t i)
{
    if (kind == I8_F32)
        return ((const float *)x)[i];
    if (kind == I8_BF16)
        return i8_bits_f32((uint32_t)((const uint16_t *)x)[i] << 16);
    if (kind == I8_F16) {
        uint32_t h = ((const uint16_t *)x)[i];
        float a = i8_bits_f32((h & 0x7FFFu) << 13) * 0x1.0p112f;
        return i8_bits_f32(i8_f32_bits(a) | (h & 0x8000u) << 16);
    }
    return (float)((const double *)x)[i];
}

/* max |x| of a row of n elements as float32 (the max of the float32 values' magnitudes: the
 * float64 one rounded, as rounding keeps order), from the magnitudes' bits compared as integers
 * (the order of non-negative floats); -1 when the row holds a NaN or an Inf (one in float32). */
static inline __attribute__((always_inline)) float i8_absmax(const void *x, int kind,
                                                             Py_ssize_t n)
{
    if (kind == I8_F32) {
        const uint32_t *u = x;
        int32_t m = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            int32_t k = (int32_t)(u[i] & 0x7FFFFFFFu);
            m = k > m ? k : m;
        }
        return m >= 0x7F800000 ? -1.0f : i8_bits_f32((uint32_t)m);
    }
    if (kind == I8_BF16 || kind == I8_F16) {
        const uint16_t *h = x;
        int16_t m = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            int16_t k = (int16_t)(h[i] & 0x7FFFu);
            m = k > m ? k : m;
        }
        if (kind == I8_BF16)
            return m >= 0x7F80 ? -1.0f : i8_bits_f32((uint32_t)m << 16);
        return m >= 0x7C00 ? -1.0f : f16_to_f32((uint16_t)m);
    }
    const uint64_t *u = x;
    int64_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t k = (int64_t)(u[i] & 0x7FFFFFFFFFFFFFFFull);
        m = k > m ? k : m;
    }
    double d;
    memcpy(&d, &m, 8);
    float f = (float)d;  /* NaN stays NaN; above FLT_MAX (rounded) is Inf */
    return f <= FLT_MAX ? f : -1.0f;
}

/* Rows [r0, r1) of x (`cols` elements each, of `kind`) to codes q and scales: scale = max|x| /
 * 127, q = clamp(round_half_even(x / scale), -127, 127) in float32, q = 0 for a scale of 0.
 * Returns the first row holding a NaN or an Inf (nothing written for it or after it), or -1.
 * The rounding is a float32 add of 1.5 * 2^23 (to even, as ggml's nearest_int), exact while
 * |x / scale| < 2^22: it is under 255 (under 127.00002 for a normal scale; a subnormal one is
 * at least half of max|x| / 127). The clamp is on the integers so that the loop vectorises (a
 * float compare may trap, which keeps GCC from if-converting it). `kind` is a constant where
 * this is inlined, so each kind gets its own loops. */
static inline __attribute__((always_inline)) Py_ssize_t
i8_quantize_rows(const void *x, int kind, int8_t *q, float *scale, Py_ssize_t cols,
                 Py_ssize_t r0, Py_ssize_t r1)
{
    for (Py_ssize_t r = r0; r < r1; r++) {
        const void *row = (const char *)x + r * cols * i8_size[kind];
        int8_t *restrict qr = q + r * cols;
        float am = i8_absmax(row, kind, cols);
        if (am < 0.0f)
            return r;
        float s = am / I8_MAX;
        scale[r] = s;
        if (s == 0.0f) {
            memset(qr, 0, (size_t)cols);
            continue;
        }
        for (Py_ssize_t i = 0; i < cols; i++) {
            float v = i8_load(row, kind, i) / s;
            int32_t k = (int32_t)i8_f32_bits(v + 12582912.0f) - 0x4B400000;
            k = k < -127 ? -127 : k;
            qr[i] = (int8_t)(k > 127 ? 127 : k);
        }
    }
    return -1;
}

static inline __attribute__((always_inline)) Py_ssize_t
i8_quantize_body(const void *x, int kind, int8_t *q, float *scale, Py_ssize_t cols,
                 Py_ssize_t r0, Py_ssize_t r1)
{
    switch (kind) {
    case I8_F32:
        return i8_quantize_rows(x, I8_F32, q, scale, cols, r0, r1);
    case I8_BF16:
        return i8_quantize_rows(x, I8_BF16, q, scale, cols, r0, r1);
    case I8_F16:
        return i8_quantize_rows(x, I8_F16, q, scale, cols, r0, r1);
    default:
        return i8_quantize_rows(x, I8_F64, q, scale, cols, r0, r1);
    }
}

/* float32 -> float16 bits, to nearest even as torch's cast (the FP16 library's
 * fp16_ieee_from_fp32_value, which c10::Half uses: two exact scalings and one float add that
 * rounds), without a branch so that it vectorises; a NaN keeps its top payload bits, as the
 * hardware conversion does. The same bits as to_f16 for every one of the 2^32 inputs. */
static inline __attribute__((always_inline)) uint16_t i8_to_f16(float f)
{
    float base = (fabsf(f) * 0x1.0p112f) * 0x1.0p-110f;
    uint32_t w = i8_f32_bits(f);
    int32_t a = (int32_t)(w & 0x7FFFFFFFu), e = (int32_t)(w & 0x7F800000u);
    e = e < 0x38800000 ? 0x38800000 : e;  /* signed: vectorises without unsigned compares */
    uint32_t b = i8_f32_bits(i8_bits_f32((uint32_t)e + 0x07800000u) + base);
    uint32_t nonsign = ((b >> 13) & 0x7C00u) + (b & 0x0FFFu);
    uint32_t nan = 0x7E00u | ((w >> 13) & 0x3FFu), is_nan = -(uint32_t)(a > 0x7F800000);
    /* a mask, not a branch: GCC does not if-convert an arm that holds a float add */
    return (uint16_t)((w & 0x80000000u) >> 16 | (nan & is_nan) | (nonsign & ~is_nan));
}

/* Rows [r0, r1) of codes q to out: q * scale in float32, then float32, bfloat16 or float16
 * (torch's casts, to nearest even). */
static inline __attribute__((always_inline)) void
i8_dequant_rows(const int8_t *q, const float *scale, void *out, int kind, Py_ssize_t cols,
                Py_ssize_t r0, Py_ssize_t r1)
{
    for (Py_ssize_t r = r0; r < r1; r++) {
        const int8_t *restrict qr = q + r * cols;
        const float s = scale[r];
        if (kind == I8_F32) {
            float *restrict o = (float *)out + r * cols;
            for (Py_ssize_t i = 0; i < cols; i++)
                o[i] = (float)qr[i] * s;
        } else if (kind == I8_BF16) {
            uint16_t *restrict o = (uint16_t *)out + r * cols;
            for (Py_ssize_t i = 0; i < cols; i++)
                o[i] = to_bf16((float)qr[i] * s);
        } else {
            uint16_t *restrict o = (uint16_t *)out + r * cols;
            for (Py_ssize_t i = 0; i < cols; i++)
                o[i] = i8_to_f16((float)qr[i] * s);
        }
    }
}

static inline __attribute__((always_inline)) void
i8_dequant_body(const int8_t *q, const float *scale, void *out, int kind, Py_ssize_t cols,
                Py_ssize_t r0, Py_ssize_t r1)
{
    switch (kind) {
    case I8_F32:
        i8_dequant_rows(q, scale, out, I8_F32, cols, r0, r1);
        break;
    case I8_BF16:
        i8_dequant_rows(q, scale, out, I8_BF16, cols, r0, r1);
        break;
    default:
        i8_dequant_rows(q, scale, out, I8_F16, cols, r0, r1);
    }
}

static Py_ssize_t i8_quantize_c(const void *x, int kind, int8_t *q, float *scale,
                                Py_ssize_t cols, Py_ssize_t r0, Py_ssize_t r1)
{
    return i8_quantize_body(x, kind, q, scale, cols, r0, r1);
}

static void i8_dequant_c(const int8_t *q, const float *scale, void *out, int kind,
                         Py_ssize_t cols, Py_ssize_t r0, Py_ssize_t r1)
{
    i8_dequant_body(q, scale, out, kind, cols, r0, r1);
}

#ifdef CODEC_X86
/* The same bodies with AVX2: 8 float32 lanes a register (and still no FMA). */
__attribute__((target("avx2"))) static Py_ssize_t
i8_quantize_avx2(const void *x, int kind, int8_t *q, float *scale, Py_ssize_t cols,
                 Py_ssize_t r0, Py_ssize_t r1)
{
    return i8_quantize_body(x, kind, q, scale, cols, r0, r1);
}

__attribute__((target("avx2"))) static void
i8_dequant_avx2(const int8_t *q, const float *scale, void *out, int kind, Py_ssize_t cols,
                Py_ssize_t r0, Py_ssize_t r1)
{
    i8_dequant_body(q, scale, out, kind, cols, r0, r1);
}
#endif

#if defined(__clang__)
#pragma STDC FP_CONTRACT ON
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

/* A share of an int8 call for one thread: rows [r0, r1). */
typedef struct {
    const void *x;   /* quantize: the elements; dequantize: the codes */
    void *q;         /* quantize: the codes; dequantize: the output */
    float *scale;
    Py_ssize_t cols, r0, r1, bad;
    int kind, isa, quantize;
} i8_job;

static void *i8_worker(void *arg)
{
    i8_job *j = arg;
#ifdef CODEC_X86
    if (j->isa == 1) {
        if (j->quantize)
            j->bad = i8_quantize_avx2(j->x, j->kind, j->q, j->scale, j->cols, j->r0, j->r1);
        else
            i8_dequant_avx2(j->x, j->scale, j->q, j->kind, j->cols, j->r0, j->r1);
        return NULL;
    }
#endif
    if (j->quantize)
        j->bad = i8_quantize_c(j->x, j->kind, j->q, j->scale, j->cols, j->r0, j->r1);
    else
        i8_dequant_c(j->x, j->scale, j->q, j->kind, j->cols, j->r0, j->r1);
    return NULL;
}

/* Elements a thread gets at least (a thread start costs some tens of microseconds). */
#define I8_SHARE 65536

/* Split `rows` evenly over `threads` (1..64, fewer when the shares would be small) and run them
 * (run_jobs). Call without the GIL. Returns the first bad row of a quantize, or -1. */
static Py_ssize_t i8_run(const void *x, void *q, float *scale, Py_ssize_t rows, Py_ssize_t cols,
                         int kind, int threads, int isa, int quantize)
{
    i8_job jobs[64];
    Py_ssize_t most = cols ? rows / (I8_SHARE / cols + 1) : 1;
    if (threads > 64)
        threads = 64;
    if (threads > most)
        threads = (int)most;
    if (threads < 1)
        threads = 1;
    for (int t = 0; t < threads; t++)
        jobs[t] = (i8_job){x, q, scale, cols, rows * t / threads, rows * (t + 1) / threads, -1,
                           kind, isa, quantize};
    run_jobs(i8_worker, jobs, sizeof jobs[0], threads);
    Py_ssize_t bad = -1;
    for (int t = 0; t < threads && bad < 0; t++)
        bad = jobs[t].bad;  /* shares are in row order: the first bad one is the first */
    return bad;
}

/* The checks int8_quantize and int8_dequant share: the kind (up to `kinds`), `cols`, the elements'
 * bytes, the codes' and the scales' against rows = scales / 4, and the alignment of the
 * elements and the scales. Returns the row count, or -1 with a ValueError set. */
static Py_ssize_t i8_layout(const char *fn, int kind, int kinds, Py_ssize_t cols,
                            const Py_buffer *elems, Py_ssize_t codes_len, const Py_buffer *scale)
{
    if (kind < 0 || kind >= kinds) {
        PyErr_Format(PyExc_ValueError, "%s: kind must be 0..%d (float32, bfloat16, float16%s)",
                     fn, kinds - 1, kinds == 4 ? ", float64" : "");
        return -1;
    }
    Py_ssize_t size = i8_size[kind], rows = scale->len / 4;
    if (cols < 0 || scale->len % 4 || (rows && cols > PY_SSIZE_T_MAX / 8 / rows)) {
        PyErr_Format(PyExc_ValueError, "%s: %zd scale bytes and %zd columns are not rows of a "
                     "table", fn, scale->len, cols);
        return -1;
    }
    if (elems->len != rows * cols * size || codes_len != rows * cols) {
        PyErr_Format(PyExc_ValueError, "%s: %zd rows of %zd need %zd bytes of %s elements and "
                     "%zd of codes, got %zd and %zd", fn, rows, cols, rows * cols * size,
                     i8_name[kind], rows * cols, elems->len, codes_len);
        return -1;
    }
    if (((uintptr_t)elems->buf) % size || ((uintptr_t)scale->buf) % 4) {
        PyErr_Format(PyExc_ValueError, "%s: a buffer is not aligned", fn);
        return -1;
    }
    return rows;
}

static PyObject *int8_quantize(PyObject *self, PyObject *args)
{
    Py_buffer x, q, scale;
    int kind, threads, isa;
    Py_ssize_t cols;
    if (!PyArg_ParseTuple(args, "y*iw*w*nii", &x, &kind, &q, &scale, &cols, &threads, &isa))
        return NULL;
    PyObject *ret = NULL;
    Py_ssize_t rows = i8_layout("int8_quantize", kind, 4, cols, &x, q.len, &scale);
    int best = codec_best_isa();
    if (rows < 0) {
        /* error set */
    } else if (isa < -1 || isa > best) {
        PyErr_Format(PyExc_ValueError, "int8_quantize: isa %d is not one this CPU runs "
                     "(-1 for the best, 0..%d)", isa, best);
    } else {
        Py_ssize_t bad;
        Py_BEGIN_ALLOW_THREADS
        bad = i8_run(x.buf, q.buf, scale.buf, rows, cols, kind, threads, isa < 0 ? best : isa, 1);
        Py_END_ALLOW_THREADS
        ret = PyLong_FromSsize_t(bad);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&q);
    PyBuffer_Release(&scale);
    return ret;
}

static PyObject *int8_dequant(PyObject *self, PyObject *args)
{
    Py_buffer q, scale, out;
    int kind, threads, isa;
    Py_ssize_t cols;
    if (!PyArg_ParseTuple(args, "y*y*w*inii", &q, &scale, &out, &kind, &cols, &threads, &isa))
        return NULL;
    PyObject *ret = NULL;
    Py_ssize_t rows = i8_layout("int8_dequant", kind, 3, cols, &out, q.len, &scale);
    int best = codec_best_isa();
    if (rows < 0) {
        /* error set */
    } else if (isa < -1 || isa > best) {
        PyErr_Format(PyExc_ValueError, "int8_dequant: isa %d is not one this CPU runs "
                     "(-1 for the best, 0..%d)", isa, best);
    } else {
        Py_BEGIN_ALLOW_THREADS
        i8_run(q.buf, out.buf, scale.buf, rows, cols, kind, threads, isa < 0 ? best : isa, 0);
        Py_END_ALLOW_THREADS
        ret = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&q);
    PyBuffer_Release(&scale);
    PyBuffer_Release(&out);
    return ret;
}

static PyMethodDef methods[] = {
    {"join_planes", join_planes, METH_VARARGS,
     "join_planes(hi, lo, out, width): planes decode of n elements of 2 or 4 bytes."},
    {"decode_frames", decode_frames, METH_VARARGS,
     "decode_frames(stored, out, table, width) -> None, or (row, message) for a bad frame."},
    {"zstd_available", zstd_available, METH_NOARGS, "Whether libzstd could be loaded."},
    {"nf4_quantize", nf4_quantize, METH_VARARGS,
     "nf4_quantize(x, kind, mids, packed, absmax, blocksize) -> first bad block or -1."},
    {"nf4_dequant", nf4_dequant, METH_VARARGS,
     "nf4_dequant(packed, absmax, code, out, blocksize, kind): NF4 to float32 (0) or bf16 (1)."},
    {"q8_0_quantize", q8_0_quantize, METH_VARARGS,
     "q8_0_quantize(x, kind, out) -> first bad block or -1: llama.cpp's Q8_0 blocks."},
    {"q8_0_dequant", q8_0_dequant, METH_VARARGS,
     "q8_0_dequant(blocks, out, kind): Q8_0 to float32 (0) or bf16 (1)."},
    {"q6_k_quantize", q6_k_quantize, METH_VARARGS,
     "q6_k_quantize(x, kind, out, threads, isa) -> first bad block or -1: llama.cpp's Q6_K."},
    {"q6_k_dequant", q6_k_dequant, METH_VARARGS,
     "q6_k_dequant(blocks, out, kind, threads): Q6_K to float32 (0) or bf16 (1)."},
    {"codec_isa", codec_isa, METH_NOARGS,
     "codec_isa() -> the widest instruction set the threaded codecs use here: 0 plain C, "
     "1 AVX2."},
    {"int8_quantize", int8_quantize, METH_VARARGS,
     "int8_quantize(x, kind, q, scale, cols, threads, isa) -> first bad row or -1."},
    {"int8_dequant", int8_dequant, METH_VARARGS,
     "int8_dequant(q, scale, out, kind, cols, threads, isa): int8 rows to float32 (0), bf16 (1) "
     "or float16 (2)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "lct.format._native",
    "The LCT format's native inner loops (see lct/format/native.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModule_Create(&module);
}
