/* lct._native: the inner loops that Python can only do in several passes, or only while
 * holding the GIL between every frame.
 *
 *   join_planes(hi, lo, out, width)   planes codec decode (FORMAT.md 5): one pass from the
 *                                     exponent plane and the sign/mantissa plane to the elements.
 *   decode_frames(stored, out, table, width)
 *                                     a run of a chunk's frames (zstd, or planes when width is
 *                                     2 or 4) decoded with the GIL released for the whole run,
 *                                     through the system's libzstd (loaded with dlopen; absent
 *                                     library: zstd_available() is False and Python decodes).
 *   nf4_quantize(x, kind, mids, packed, absmax, blocksize)
 *                                     NF4 from float32 (kind 0) or bfloat16 (kind 1), byte-
 *                                     identical to bitsandbytes' CPU quantize_4bit (lct/nf4.py).
 *   nf4_dequant(packed, absmax, code, out, blocksize, kind)
 *                                     NF4 to float32 (kind 0) or bfloat16 (kind 1), bit-identical
 *                                     to bitsandbytes' dequantize_4bit and torch's float->bf16 cast.
 *
 * Both take buffer-protocol objects, check every length before touching memory, and release the
 * GIL while they run, so that decode threads work in parallel. lct/native.py wraps them and falls
 * back to numpy/torch when this module was not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <pthread.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* The rule of lct/nf4.py: absmax per block in float32, scale by the float32 reciprocal, code =
 * number of the 15 float32 midpoints strictly below the scaled value, all-zero block -> code 7,
 * first element of a pair in the high nibble, an odd tail padded with code 7. Each pass is a
 * plain loop over one block so that the compiler vectorises it. `v` and `c` hold blocksize + 1
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

/* ---- Fused NF4 matmul: out[M, N] = x[M, K] @ W.T with W [N, K] in NF4 ---------------------
 *
 * Reads the packed codes (0.5 byte per weight) and one float32 absmax per block, never builds a
 * row of weights in memory: each 16 (AVX-512) or 8 (AVX2) codes become floats in registers by a
 * table permute, are multiplied with x in float32, summed per block, and the block sum is scaled
 * by the block's absmax. x is split once into its even and odd elements (a byte holds element 2j
 * in its high nibble and 2j+1 in its low one), so the high codes meet the even x and the low codes
 * the odd x with no shuffle. Output rows are split over `threads` POSIX threads, GIL released.
 * Accumulation is float32 throughout; only the summation order differs from a float32 reference.
 */
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
#define MM_TILE 4   /* rows of x sharing one decode of a weight vector */

typedef struct {
    const uint8_t *packed;                 /* NF4 codes [N, K/2], or int8 codes [N, K] */
    const float *absmax, *code, *xe, *xo;  /* xe/xo: [M, K/2] even and odd elements of x */
    void *out;
    Py_ssize_t M, N, K, blocksize, n0, n1;
    int out_kind, isa;
    int int8;                              /* 1: int8 codes, absmax = one scale per row, x in xe */
} mm_job;

static inline void mm_store(const mm_job *j, Py_ssize_t m, Py_ssize_t n, float v)
{
    if (j->out_kind == 0)
        ((float *)j->out)[m * j->N + n] = v;
    else
        ((uint16_t *)j->out)[m * j->N + n] = to_bf16(v);
}

/* A row kernel: output row at packed codes `p` (absmax `am`) against rows m0..m0+mt-1 of x,
 * one instruction set and one tile size mt each (a constant, so accumulators stay in
 * registers); results in res[0..mt-1]. */
typedef void (*mm_row_fn)(const mm_job *j, const uint8_t *p, const float *am, Py_ssize_t m0,
                          float *res);

static inline void mm_row_c(const mm_job *j, const uint8_t *p, const float *am, Py_ssize_t m0,
                            int mt, float *res)
{
    Py_ssize_t half = j->K / 2, hb = j->blocksize / 2, bpr = j->K / j->blocksize;
    for (int t = 0; t < mt; t++) {
        const float *xe = j->xe + (m0 + t) * half, *xo = j->xo + (m0 + t) * half;
        float acc = 0.0f;
        for (Py_ssize_t b = 0; b < bpr; b++) {
            float s = 0.0f;
            for (Py_ssize_t i = b * hb; i < (b + 1) * hb; i++)
                s += j->code[p[i] >> 4] * xe[i] + j->code[p[i] & 15] * xo[i];
            acc += s * am[b];
        }
        res[t] = acc;
    }
}

#define MM_ROW_FN(PREFIX, KERNEL, TARGET, T)                                                  \
    TARGET static void PREFIX##_##T(const mm_job *j, const uint8_t *p, const float *am,        \
                                    Py_ssize_t m0, float *res)                                 \
    {                                                                                          \
        KERNEL(j, p, am, m0, T, res);                                                          \
    }
#define MM_ROW_FNS(PREFIX, KERNEL, TARGET)                                                    \
    MM_ROW_FN(PREFIX, KERNEL, TARGET, 1)                                                      \
    MM_ROW_FN(PREFIX, KERNEL, TARGET, 2)                                                      \
    MM_ROW_FN(PREFIX, KERNEL, TARGET, 3)                                                      \
    MM_ROW_FN(PREFIX, KERNEL, TARGET, 4)                                                      \
    static const mm_row_fn PREFIX[MM_TILE] = {PREFIX##_1, PREFIX##_2, PREFIX##_3, PREFIX##_4};

MM_ROW_FNS(mm_rows_c, mm_row_c, )

/* int8 rows: the dot product of one row of codes (`p`, signed bytes) with rows of x (float32
 * [M, K] in xe); the row's scale is applied by the caller. Same signature as the NF4 kernels. */
static inline void i8_row_c(const mm_job *j, const uint8_t *p, const float *am, Py_ssize_t m0,
                            int mt, float *res)
{
    const int8_t *q = (const int8_t *)p;
    for (int t = 0; t < mt; t++) {
        const float *x = j->xe + (m0 + t) * j->K;
        float acc = 0.0f;
        for (Py_ssize_t i = 0; i < j->K; i++)
            acc += (float)q[i] * x[i];
        res[t] = acc;
    }
}

MM_ROW_FNS(i8_rows_c, i8_row_c, )

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LCT_X86 1

/* The same algorithm at two vector widths (16 and 8 lanes); only the intrinsics differ. */
__attribute__((target("avx512f"), always_inline)) static inline void
mm_row512(const mm_job *j, const uint8_t *p, const float *am, Py_ssize_t m0, int mt, float *res)
{
    Py_ssize_t half = j->K / 2, hb = j->blocksize / 2, bpr = j->K / j->blocksize;
    const __m512 table = _mm512_loadu_ps(j->code);
    const __m512i low = _mm512_set1_epi32(15);
    __m512 acc[MM_TILE];
    for (int t = 0; t < mt; t++)
        acc[t] = _mm512_setzero_ps();
    for (Py_ssize_t b = 0; b < bpr; b++) {
        __m512 s[MM_TILE], s2[MM_TILE];  /* two chains: the FMAs do not wait on each other */
        for (int t = 0; t < mt; t++)
            s[t] = s2[t] = _mm512_setzero_ps();
        for (Py_ssize_t i = b * hb; i < (b + 1) * hb; i += 16) {
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + i)));
            __m512 wh = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
            __m512 wl = _mm512_permutexvar_ps(_mm512_and_si512(v, low), table);
            for (int t = 0; t < mt; t++) {
                const float *xe = j->xe + (m0 + t) * half, *xo = j->xo + (m0 + t) * half;
                s[t] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xe + i), s[t]);
                s2[t] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xo + i), s2[t]);
            }
        }
        __m512 a = _mm512_set1_ps(am[b]);
        for (int t = 0; t < mt; t++)
            acc[t] = _mm512_fmadd_ps(_mm512_add_ps(s[t], s2[t]), a, acc[t]);
    }
    for (int t = 0; t < mt; t++)
        res[t] = _mm512_reduce_add_ps(acc[t]);
}

/* 16-entry table lookup on 8 lanes: two 8-entry permutes, bit 3 of the index picks one. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256
lookup16(__m256 lo, __m256 hi, __m256i idx)
{
    __m256 a = _mm256_permutevar8x32_ps(lo, idx), b = _mm256_permutevar8x32_ps(hi, idx);
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

__attribute__((target("avx2,fma"), always_inline)) static inline float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"), always_inline)) static inline void
mm_row256(const mm_job *j, const uint8_t *p, const float *am, Py_ssize_t m0, int mt, float *res)
{
    Py_ssize_t half = j->K / 2, hb = j->blocksize / 2, bpr = j->K / j->blocksize;
    const __m256 tlo = _mm256_loadu_ps(j->code), thi = _mm256_loadu_ps(j->code + 8);
    const __m256i low = _mm256_set1_epi32(15);
    __m256 acc[MM_TILE];
    for (int t = 0; t < mt; t++)
        acc[t] = _mm256_setzero_ps();
    for (Py_ssize_t b = 0; b < bpr; b++) {
        __m256 s[MM_TILE], s2[MM_TILE];
        for (int t = 0; t < mt; t++)
            s[t] = s2[t] = _mm256_setzero_ps();
        for (Py_ssize_t i = b * hb; i < (b + 1) * hb; i += 8) {
            __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + i)));
            __m256 wh = lookup16(tlo, thi, _mm256_srli_epi32(v, 4));
            __m256 wl = lookup16(tlo, thi, _mm256_and_si256(v, low));
            for (int t = 0; t < mt; t++) {
                const float *xe = j->xe + (m0 + t) * half, *xo = j->xo + (m0 + t) * half;
                s[t] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(xe + i), s[t]);
                s2[t] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(xo + i), s2[t]);
            }
        }
        __m256 a = _mm256_set1_ps(am[b]);
        for (int t = 0; t < mt; t++)
            acc[t] = _mm256_fmadd_ps(_mm256_add_ps(s[t], s2[t]), a, acc[t]);
    }
    for (int t = 0; t < mt; t++)
        res[t] = hsum256(acc[t]);
}

/* int8 codes widened to float32 16 (8) at a time; two FMA chains per input row. */
__attribute__((target("avx512f"), always_inline)) static inline void
i8_row512(const mm_job *j, const uint8_t *p, const float *am, Py_ssize_t m0, int mt, float *res)
{
    __m512 s[MM_TILE], s2[MM_TILE];
    for (int t = 0; t < mt; t++)
        s[t] = s2[t] = _mm512_setzero_ps();
    for (Py_ssize_t i = 0; i < j->K; i += 32) {
        __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + i))));
        __m512 w2 = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + i + 16))));
        for (int t = 0; t < mt; t++) {
            const float *x = j->xe + (m0 + t) * j->K + i;
            s[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x), s[t]);
            s2[t] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(x + 16), s2[t]);
        }
    }
    for (int t = 0; t < mt; t++)
        res[t] = _mm512_reduce_add_ps(_mm512_add_ps(s[t], s2[t]));
}

__attribute__((target("avx2,fma"), always_inline)) static inline void
i8_row256(const mm_job *j, const uint8_t *p, const float *am, Py_ssize_t m0, int mt, float *res)
{
    __m256 s[MM_TILE], s2[MM_TILE];
    for (int t = 0; t < mt; t++)
        s[t] = s2[t] = _mm256_setzero_ps();
    for (Py_ssize_t i = 0; i < j->K; i += 16) {
        __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + i))));
        __m256 w2 = _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + i + 8))));
        for (int t = 0; t < mt; t++) {
            const float *x = j->xe + (m0 + t) * j->K + i;
            s[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x), s[t]);
            s2[t] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 8), s2[t]);
        }
    }
    for (int t = 0; t < mt; t++)
        res[t] = hsum256(_mm256_add_ps(s[t], s2[t]));
}

MM_ROW_FNS(i8_rows_avx512, i8_row512, __attribute__((target("avx512f"))))
MM_ROW_FNS(i8_rows_avx2, i8_row256, __attribute__((target("avx2,fma"))))
MM_ROW_FNS(mm_rows_avx512, mm_row512, __attribute__((target("avx512f"))))
MM_ROW_FNS(mm_rows_avx2, mm_row256, __attribute__((target("avx2,fma"))))
#endif

/* Every output row of the job's share, input rows in tiles of up to MM_TILE. */
static void mm_rows(const mm_job *j, const mm_row_fn rows[MM_TILE])
{
    /* NF4: K/2 code bytes and K/blocksize absmax per row; int8: K codes and one scale. */
    Py_ssize_t stride = j->int8 ? j->K : j->K / 2, bpr = j->int8 ? 1 : j->K / j->blocksize;
    float res[MM_TILE];
    for (Py_ssize_t n = j->n0; n < j->n1; n++) {
        const uint8_t *p = j->packed + n * stride;
        const float *am = j->absmax + n * bpr;
        float scale = j->int8 ? am[0] : 1.0f;
        for (Py_ssize_t m0 = 0; m0 < j->M; m0 += MM_TILE) {
            int mt = j->M - m0 < MM_TILE ? (int)(j->M - m0) : MM_TILE;
            rows[mt - 1](j, p, am, m0, res);
            for (int t = 0; t < mt; t++)
                mm_store(j, m0 + t, n, res[t] * scale);
        }
    }
}

/* The widest instruction set this CPU runs; LCT_NATIVE_ISA=scalar|avx2 caps it (A/B runs). */
static int best_isa(void)
{
    static int isa = -1;
    if (isa >= 0)
        return isa;
    int found = ISA_SCALAR;
#ifdef LCT_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        found = ISA_AVX2;
    if (__builtin_cpu_supports("avx512f"))
        found = ISA_AVX512;
#endif
    const char *cap = getenv("LCT_NATIVE_ISA");
    if (cap && !strcmp(cap, "scalar"))
        found = ISA_SCALAR;
    else if (cap && !strcmp(cap, "avx2") && found > ISA_AVX2)
        found = ISA_AVX2;
    return isa = found;
}

/* The step (in packed bytes) an instruction set's loop takes; a block must hold whole steps. */
static Py_ssize_t isa_step(int isa)
{
    return isa == ISA_AVX512 ? 16 : isa == ISA_AVX2 ? 8 : 1;
}

static void *mm_worker(void *arg)
{
    const mm_job *j = arg;
#ifdef LCT_X86
    if (j->isa == ISA_AVX512) {
        mm_rows(j, j->int8 ? i8_rows_avx512 : mm_rows_avx512);
        return NULL;
    }
    if (j->isa == ISA_AVX2) {
        mm_rows(j, j->int8 ? i8_rows_avx2 : mm_rows_avx2);
        return NULL;
    }
#endif
    mm_rows(j, j->int8 ? i8_rows_c : mm_rows_c);
    return NULL;
}

/* Run `threads` jobs (output rows split evenly), thread 0's share on the calling thread; a share
 * whose thread cannot be started runs here too. Call with the GIL released. */
static void mm_run(mm_job *jobs, pthread_t *tids, int threads)
{
    char started[64] = {0};
    for (int t = 1; t < threads; t++) {
        started[t] = pthread_create(&tids[t], NULL, mm_worker, &jobs[t]) == 0;
        if (!started[t])
            mm_worker(&jobs[t]);
    }
    mm_worker(&jobs[0]);
    for (int t = 1; t < threads; t++)
        if (started[t])
            pthread_join(tids[t], NULL);
}

/* Threads for an N-row output: 1..64, at most N. */
static int mm_threads(int threads, Py_ssize_t N)
{
    if (threads < 1)
        threads = 1;
    if (threads > 64)
        threads = 64;
    if (threads > N)
        threads = (int)N;
    return threads;
}

static PyObject *nf4_matmul_isa(PyObject *self, PyObject *args)
{
    static const char *names[] = {"scalar", "avx2", "avx512"};
    return PyUnicode_FromString(names[best_isa()]);
}

static PyObject *nf4_matmul(PyObject *self, PyObject *args)
{
    Py_buffer x, packed, absmax, code, out;
    Py_ssize_t M, N, K, blocksize;
    int x_kind, out_kind, threads, isa;
    if (!PyArg_ParseTuple(args, "y*iy*y*y*w*innnnii", &x, &x_kind, &packed, &absmax, &code, &out,
                          &out_kind, &M, &N, &K, &blocksize, &threads, &isa))
        return NULL;
    PyObject *ret = NULL;
    Py_ssize_t xs = x_kind == 0 ? 4 : 2, os = out_kind == 0 ? 4 : 2;
    if (isa < 0 || isa > best_isa())
        isa = best_isa();
    if ((x_kind != 0 && x_kind != 1) || (out_kind != 0 && out_kind != 1)) {
        PyErr_SetString(PyExc_ValueError, "nf4_matmul: kinds must be 0 (float32) or 1 (bfloat16)");
    } else if (M <= 0 || N <= 0 || K <= 0 || blocksize <= 0 || blocksize % 2 || K % blocksize
               || M > PY_SSIZE_T_MAX / K || N > PY_SSIZE_T_MAX / K || M > PY_SSIZE_T_MAX / N) {
        PyErr_Format(PyExc_ValueError, "nf4_matmul: bad shape M=%zd N=%zd K=%zd blocksize=%zd "
                     "(positive, blocksize even and dividing K)", M, N, K, blocksize);
    } else if (x.len != M * K * xs || packed.len != N * (K / 2) || absmax.len != N * (K / blocksize) * 4
               || out.len != M * N * os || code.len != 16 * 4) {
        PyErr_Format(PyExc_ValueError, "nf4_matmul: buffer sizes %zd/%zd/%zd/%zd/%zd do not match "
                     "M=%zd N=%zd K=%zd blocksize=%zd", x.len, packed.len, absmax.len, out.len,
                     code.len, M, N, K, blocksize);
    } else if (((uintptr_t)x.buf) % xs || ((uintptr_t)out.buf) % os
               || ((uintptr_t)absmax.buf) % 4 || ((uintptr_t)code.buf) % 4) {
        PyErr_SetString(PyExc_ValueError, "nf4_matmul: a buffer is not aligned");
    } else {
        threads = mm_threads(threads, N);
        if ((blocksize / 2) % isa_step(isa))
            isa = ISA_SCALAR;
        Py_ssize_t half = K / 2;
        float *xeo = malloc((size_t)M * K * sizeof(float));
        mm_job *jobs = malloc((size_t)threads * sizeof(mm_job));
        pthread_t *tids = malloc((size_t)threads * sizeof(pthread_t));
        if (!xeo || !jobs || !tids) {
            free(xeo);
            free(jobs);
            free(tids);
            PyErr_NoMemory();
        } else {
            Py_BEGIN_ALLOW_THREADS
            float *xe = xeo, *xo = xeo + M * half;
            for (Py_ssize_t m = 0; m < M; m++)
                for (Py_ssize_t i = 0; i < half; i++) {
                    Py_ssize_t k = m * K + 2 * i;
                    float e, o;
                    if (x_kind == 0) {
                        e = ((const float *)x.buf)[k];
                        o = ((const float *)x.buf)[k + 1];
                    } else {
                        uint32_t ue = (uint32_t)((const uint16_t *)x.buf)[k] << 16;
                        uint32_t uo = (uint32_t)((const uint16_t *)x.buf)[k + 1] << 16;
                        memcpy(&e, &ue, 4);
                        memcpy(&o, &uo, 4);
                    }
                    xe[m * half + i] = e;
                    xo[m * half + i] = o;
                }
            for (int t = 0; t < threads; t++) {
                mm_job jb = {packed.buf, absmax.buf, code.buf, xe, xo, out.buf, M, N, K,
                             blocksize, N * t / threads, N * (t + 1) / threads, out_kind, isa, 0};
                jobs[t] = jb;
            }
            mm_run(jobs, tids, threads);
            Py_END_ALLOW_THREADS
            free(xeo);
            free(jobs);
            free(tids);
            ret = Py_NewRef(Py_None);
        }
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&packed);
    PyBuffer_Release(&absmax);
    PyBuffer_Release(&code);
    PyBuffer_Release(&out);
    return ret;
}

/* out[M, N] = x[M, K] @ (q * scale[:, None]).T with q int8 [N, K], one float32 scale per row. */
static PyObject *int8_matmul(PyObject *self, PyObject *args)
{
    Py_buffer x, q, scale, out;
    Py_ssize_t M, N, K;
    int x_kind, out_kind, threads, isa;
    if (!PyArg_ParseTuple(args, "y*iy*y*w*innnii", &x, &x_kind, &q, &scale, &out, &out_kind, &M,
                          &N, &K, &threads, &isa))
        return NULL;
    PyObject *ret = NULL;
    Py_ssize_t xs = x_kind == 0 ? 4 : 2, os = out_kind == 0 ? 4 : 2;
    if (isa < 0 || isa > best_isa())
        isa = best_isa();
    if ((x_kind != 0 && x_kind != 1) || (out_kind != 0 && out_kind != 1)) {
        PyErr_SetString(PyExc_ValueError, "int8_matmul: kinds must be 0 (float32) or 1 (bfloat16)");
    } else if (M <= 0 || N <= 0 || K <= 0 || M > PY_SSIZE_T_MAX / K || N > PY_SSIZE_T_MAX / K
               || M > PY_SSIZE_T_MAX / N) {
        PyErr_Format(PyExc_ValueError, "int8_matmul: bad shape M=%zd N=%zd K=%zd", M, N, K);
    } else if (x.len != M * K * xs || q.len != N * K || scale.len != N * 4 || out.len != M * N * os) {
        PyErr_Format(PyExc_ValueError, "int8_matmul: buffer sizes %zd/%zd/%zd/%zd do not match "
                     "M=%zd N=%zd K=%zd", x.len, q.len, scale.len, out.len, M, N, K);
    } else if (((uintptr_t)x.buf) % xs || ((uintptr_t)out.buf) % os || ((uintptr_t)scale.buf) % 4) {
        PyErr_SetString(PyExc_ValueError, "int8_matmul: a buffer is not aligned");
    } else {
        threads = mm_threads(threads, N);
        if (K % (2 * 16))      /* the vector loops take 32 (AVX-512) or 16 (AVX2) codes a step */
            isa = K % 16 ? ISA_SCALAR : (isa == ISA_AVX512 ? ISA_AVX2 : isa);
        float *xf = malloc((size_t)M * K * sizeof(float));
        mm_job *jobs = malloc((size_t)threads * sizeof(mm_job));
        pthread_t *tids = malloc((size_t)threads * sizeof(pthread_t));
        if (!xf || !jobs || !tids) {
            free(xf);
            free(jobs);
            free(tids);
            PyErr_NoMemory();
        } else {
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t i = 0; i < M * K; i++) {
                if (x_kind == 0) {
                    xf[i] = ((const float *)x.buf)[i];
                } else {
                    uint32_t u = (uint32_t)((const uint16_t *)x.buf)[i] << 16;
                    memcpy(&xf[i], &u, 4);
                }
            }
            for (int t = 0; t < threads; t++) {
                mm_job jb = {q.buf, scale.buf, NULL, xf, NULL, out.buf, M, N, K, 1,
                             N * t / threads, N * (t + 1) / threads, out_kind, isa, 1};
                jobs[t] = jb;
            }
            mm_run(jobs, tids, threads);
            Py_END_ALLOW_THREADS
            free(xf);
            free(jobs);
            free(tids);
            ret = Py_NewRef(Py_None);
        }
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&q);
    PyBuffer_Release(&scale);
    PyBuffer_Release(&out);
    return ret;
}

static PyMethodDef methods[] = {
    {"int8_matmul", int8_matmul, METH_VARARGS,
     "int8_matmul(x, x_kind, q, scale, out, out_kind, M, N, K, threads, isa): fused int8 "
     "matmul, out[M, N] = x[M, K] @ (q * scale).T; isa -1 picks the best."},
    {"nf4_quantize", nf4_quantize, METH_VARARGS,
     "nf4_quantize(x, kind, mids, packed, absmax, blocksize) -> first bad block or -1."},
    {"decode_frames", decode_frames, METH_VARARGS,
     "decode_frames(stored, out, table, width) -> None, or (row, message) for a bad frame."},
    {"zstd_available", zstd_available, METH_NOARGS, "Whether libzstd could be loaded."},
    {"join_planes", join_planes, METH_VARARGS,
     "join_planes(hi, lo, out, width): planes decode of n elements of 2 or 4 bytes."},
    {"nf4_dequant", nf4_dequant, METH_VARARGS,
     "nf4_dequant(packed, absmax, code, out, blocksize, kind): NF4 to float32 (0) or bf16 (1)."},
    {"nf4_matmul", nf4_matmul, METH_VARARGS,
     "nf4_matmul(x, x_kind, packed, absmax, code, out, out_kind, M, N, K, blocksize, threads, "
     "isa): fused NF4 matmul, out[M, N] = x[M, K] @ W.T; isa -1 picks the best."},
    {"nf4_matmul_isa", nf4_matmul_isa, METH_NOARGS,
     "The instruction set nf4_matmul uses here: scalar, avx2 or avx512."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "lct._native", "LCT's native inner loops (see lct/native.py).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModule_Create(&module);
}
