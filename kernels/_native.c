/* lct.kernels._native: the fused CPU matmuls of LCT's LM heads, reading quantized weights in
 * place (the format's own loops, decode and NF4 codec, are lct/format/_native.c).
 *
 *   nf4_matmul(x, x_kind, packed, absmax, code, out, out_kind, M, N, K, blocksize, threads, isa)
 *                                     out[M, N] = x[M, K] @ W.T with W [N, K] in NF4
 *                                     (lct/format/nf4.py's layout), float32 sums.
 *   int8_matmul(x, x_kind, q, scale, out, out_kind, M, N, K, threads, isa)
 *                                     out[M, N] = x[M, K] @ (q * scale[:, None]).T with q int8
 *                                     [N, K] and one float32 scale per row (lct/format/int8.py).
 *   nf4_matmul_isa()                  the instruction set both use here: scalar, avx2 or avx512
 *                                     (LCT_NATIVE_ISA=scalar|avx2 caps it).
 *
 * x and out are float32 (kind 0) or bfloat16 bits (kind 1); isa -1 picks the best. Both take
 * buffer-protocol objects, check every length and alignment before touching memory, and run
 * over `threads` POSIX threads with the GIL released. kernels/native.py (lct.kernels.native)
 * wraps them; kernels/linear.py and kernels/int8.py fall back to dequantize-and-matmul in torch
 * when this module was not built or LCT_NATIVE=0.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline uint16_t to_bf16(float f)
{
    /* torch's c10::BFloat16 rounding: nearest-even, NaN to the canonical quiet NaN (the same
     * lines as lct/format/_native.c's: two extension modules share no C code). */
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f)
        return 0x7FC0;
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
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
    {"nf4_matmul", nf4_matmul, METH_VARARGS,
     "nf4_matmul(x, x_kind, packed, absmax, code, out, out_kind, M, N, K, blocksize, threads, "
     "isa): fused NF4 matmul, out[M, N] = x[M, K] @ W.T; isa -1 picks the best."},
    {"int8_matmul", int8_matmul, METH_VARARGS,
     "int8_matmul(x, x_kind, q, scale, out, out_kind, M, N, K, threads, isa): fused int8 "
     "matmul, out[M, N] = x[M, K] @ (q * scale).T; isa -1 picks the best."},
    {"nf4_matmul_isa", nf4_matmul_isa, METH_NOARGS,
     "The instruction set nf4_matmul and int8_matmul use here: scalar, avx2 or avx512."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "lct.kernels._native",
    "LCT's fused CPU matmuls over NF4 and int8 weights (see kernels/native.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModule_Create(&module);
}
