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

/* The checks q8_0_quantize and q8_0_dequant share: the kind, whole blocks of elements, and the
 * blocks' bytes. Returns the block count, or -1 with a ValueError set. */
static Py_ssize_t q8_layout(const char *fn, int kind, Py_ssize_t elem_bytes, Py_ssize_t block_len)
{
    if (kind != 0 && kind != 1) {
        PyErr_Format(PyExc_ValueError, "%s: kind must be 0 (float32) or 1 (bfloat16)", fn);
        return -1;
    }
    Py_ssize_t size = kind == 0 ? 4 : 2, n = elem_bytes / size, blocks = n / Q8_BLOCK;
    if (elem_bytes % size || n % Q8_BLOCK) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes of elements are not whole blocks of %d "
                     "%s elements", fn, elem_bytes, Q8_BLOCK, kind == 0 ? "float32" : "bfloat16");
        return -1;
    }
    if (block_len / Q8_BLOCK_BYTES != blocks || block_len % Q8_BLOCK_BYTES) {
        PyErr_Format(PyExc_ValueError, "%s: %zd elements need %zd bytes of blocks, got %zd", fn,
                     n, blocks * Q8_BLOCK_BYTES, block_len);
        return -1;
    }
    return blocks;
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
