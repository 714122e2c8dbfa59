/* lct.kernels._native: the fused CPU matmuls of LCT's LM heads, reading quantized weights in
 * place (the format's own loops, decode and NF4 codec, are lct/format/_native.c).
 *
 *   nf4_matmul(x, x_kind, packed, absmax, code, out, out_kind, M, N, K, blocksize, threads, isa)
 *                                     out[M, N] = x[M, K] @ W.T with W [N, K] in NF4
 *                                     (lct/format/nf4.py's layout), float32 sums.
 *   int8_matmul(x, x_kind, q, scale, out, out_kind, M, N, K, blocksize, threads, isa)
 *                                     out[M, N] = x[M, K] @ W.T with q int8 [N, K] and one
 *                                     float32 scale per `blocksize` codes of a row (K: per
 *                                     row), W = q * scale (lct/format/int8.py).
 *   q8_0_matmul(x, x_kind, blocks, out, out_kind, M, N, K, threads, isa)
 *                                     out[M, N] = x[M, K] @ W.T with W [N, K] in llama.cpp's
 *                                     Q8_0 (per 32 weights of a row, 34 bytes: a float16 scale d,
 *                                     then 32 int8 codes q; W = q * d), float32 sums.
 *   q6_k_matmul(x, x_kind, blocks, out, out_kind, M, N, K, threads, isa)
 *                                     out[M, N] = x[M, K] @ W.T with W [N, K] in llama.cpp's
 *                                     Q6_K (per 256 weights of a row, 210 bytes: 6-bit codes,
 *                                     16 int8 scales, a float16 d), float32 sums.
 *   tiled_matmul(kind, x, x_kind, codes, scales, table, out, out_kind, M, N, K, blocksize,
 *                w_bf16, threads, isa)
 *                                     the same products for many rows of x, any of the four
 *                                     (kind 0 NF4, 1 int8, 2 Q8_0, 3 Q6_K): tiles of W
 *                                     dequantized into cache, then register-blocked (see
 *                                     kernels/_tiled.h); w_bf16 lets it round weights to
 *                                     bfloat16 as the torch path does, for VDPBF16PS.
 *   nf4_matmul_isa()                  the instruction set they use here: scalar, avx2, avx512 or
 *                                     avx512bf16 (LCT_NATIVE_ISA=scalar|avx2|avx512 caps it).
 *
 * The first four read codes in place, one weight row against a few rows of x at a time: the
 * path for short inputs. x and out are float32 (kind 0) or bfloat16 bits (kind 1); isa -1 picks
 * the best. All take buffer-protocol objects, check every length and alignment before touching
 * memory, and run over `threads` POSIX threads with the GIL released. kernels/native.py
 * (lct.kernels.native) wraps them; kernels/paths.py picks among them and the torch path
 * (dequantize-and-matmul, also the fallback when this module was not built or LCT_NATIVE=0).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../lct/format/lct_f16.h"

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
/* ISA_AVX512BF16: AVX-512 F/BW/VL/DQ and AVX512_BF16; the fused kernels run their AVX-512 code. */
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512BF16 = 3 };
enum { MM_NF4 = 0, MM_INT8 = 1, MM_Q8_0 = 2, MM_Q6_K = 3 };  /* mm_job.codes */
#define MM_TILE 4   /* rows of x sharing one decode of a weight vector */
#define Q8_TILE 8   /* the same for Q8_0's AVX-512 kernel (its largest tile) */
#define Q8_BLOCK 32        /* Q8_0: weights per block */
#define Q8_BLOCK_BYTES 34  /* Q8_0: bytes per block, float16 d then 32 int8 codes */
#define Q6_BLOCK 256       /* Q6_K: weights per super-block */
#define Q6_BLOCK_BYTES 210 /* Q6_K: ql[128], qh[64], int8 scales[16], float16 d (last) */
/* The vector loops prefetch the codes this many bytes ahead (Q8_0, int8 and NF4): without it a
 * 256000 x 2048 head streams at a little over half the speed (measured, 1 row of x, 2 threads:
 * Q8_0 49 ms against 27; int8 53 against 42 and NF4 44 against 35, with another job running). */
#define MM_PREFETCH 4096

typedef struct {
    const uint8_t *packed;                 /* NF4 codes [N, K/2], int8 codes [N, K], or Q8_0
                                            * blocks [N, K/32 * 34] */
    const float *absmax, *code, *xe, *xo;  /* xe/xo: [M, K/2] even and odd elements of x */
    void *out;
    Py_ssize_t M, N, K, blocksize, n0, n1;
    int out_kind, isa;
    int codes;  /* MM_NF4; MM_INT8: absmax = one scale per row, x in xe; MM_Q8_0, MM_Q6_K:
                 * x in xe */
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

/* int8 per block (int8_b128): the same with one scale per block of `blocksize` codes, each
 * block's sum scaled by it (`am`: the row's scales). */
static inline void i8b_row_c(const mm_job *j, const uint8_t *p, const float *am, Py_ssize_t m0,
                             int mt, float *res)
{
    const int8_t *q = (const int8_t *)p;
    Py_ssize_t bs = j->blocksize;
    for (int t = 0; t < mt; t++) {
        const float *x = j->xe + (m0 + t) * j->K;
        float acc = 0.0f;
        for (Py_ssize_t b = 0; b < j->K / bs; b++) {
            float s = 0.0f;
            for (Py_ssize_t i = b * bs; i < (b + 1) * bs; i++)
                s += (float)q[i] * x[i];
            acc += s * am[b];
        }
        res[t] = acc;
    }
}

MM_ROW_FNS(i8b_rows_c, i8b_row_c, )

/* ---- Q8_0: W [N, K] as K/32 blocks of 34 bytes per row, each a float16 d and 32 int8 q ------
 *
 * Each weight q * d is formed in float32 (exact: an 8-bit q times an 11-bit float16
 * significand fits float32's 24 bits) and multiplied with x in float32, so the result is
 * x @ dequantized(W).T in float32 sums, whatever the summation order. Scaling the 32 weights of
 * a block once serves every row of x in the tile, where summing a block and then scaling would
 * cost one more multiply-add per block and row. d is read through a 65536-entry table of every
 * float16's float32 value (f16_table, filled at import). */
static float f16_table[65536];

static inline float q8_scale(const uint8_t *blk)
{
    return f16_table[(uint32_t)blk[0] | ((uint32_t)blk[1] << 8)];
}

static inline void q8_row_c(const mm_job *j, const uint8_t *p, const float *am, Py_ssize_t m0,
                            int mt, float *res)
{
    Py_ssize_t bpr = j->K / Q8_BLOCK;
    for (int t = 0; t < mt; t++) {
        const float *x = j->xe + (m0 + t) * j->K;
        float acc = 0.0f;
        for (Py_ssize_t b = 0; b < bpr; b++) {
            const uint8_t *blk = p + b * Q8_BLOCK_BYTES;
            const int8_t *q = (const int8_t *)(blk + 2);
            float d = q8_scale(blk);
            for (int i = 0; i < Q8_BLOCK; i++)
                acc += ((float)q[i] * d) * x[b * Q8_BLOCK + i];
        }
        res[t] = acc;
    }
}

MM_ROW_FNS(q8_rows_c, q8_row_c, )

/* ---- Q6_K: W [N, K] as K/256 super-blocks of 210 bytes per row ------------------------------
 *
 * Each weight (d * scale) * (q - 32) is formed in float32 in gguf's order (its dequantize is the
 * reference, tests/test_kernels_q6_k.py) and multiplied with x in float32. */
static inline float q6_d(const uint8_t *blk)
{
    return f16_table[(uint32_t)blk[208] | ((uint32_t)blk[209] << 8)];
}

/* One Q6_K super-block, llama.cpp's dequantize_row_q6_K: within each half of 128, value
 * 32 * g + l (g = 0..3, l = 0..31) takes low 4 bits from ql[l] (g even) or ql[l + 32] (g odd),
 * low nibble for g < 2 and high for g >= 2, and 2 high bits from qh[l] >> 2g; minus 32, times
 * (d * scales[value / 16]) in float32, as gguf's dequantize. */
static void q6_block_c(const uint8_t *blk, float *y)
{
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t *sc = (const int8_t *)(blk + 192);
    float d = q6_d(blk);
    for (int h = 0; h < 2; h++, ql += 64, qh += 32, sc += 8, y += 128)
        for (int l = 0; l < 32; l++) {
            int is = l / 16;
            int q1 = ((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32;
            int q2 = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
            int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * sc[is] * (float)q1;
            y[l + 32] = d * sc[is + 2] * (float)q2;
            y[l + 64] = d * sc[is + 4] * (float)q3;
            y[l + 96] = d * sc[is + 6] * (float)q4;
        }
}

/* A super-block's 16 sub-block scales d * scale in float32 (as q6_block_c forms them). */
static inline void q6_scales(const uint8_t *blk, float *ds)
{
    const int8_t *sc = (const int8_t *)(blk + 192);
    float d = q6_d(blk);
    for (int i = 0; i < 16; i++)
        ds[i] = d * sc[i];
}

static inline void q6_row_c(const mm_job *j, const uint8_t *p, const float *am, Py_ssize_t m0,
                            int mt, float *res)
{
    float w[Q6_BLOCK];
    Py_ssize_t bpr = j->K / Q6_BLOCK;
    for (int t = 0; t < mt; t++)
        res[t] = 0.0f;
    for (Py_ssize_t b = 0; b < bpr; b++) {
        q6_block_c(p + b * Q6_BLOCK_BYTES, w);
        for (int t = 0; t < mt; t++) {
            const float *x = j->xe + (m0 + t) * j->K + b * Q6_BLOCK;
            float acc = 0.0f;
            for (int i = 0; i < Q6_BLOCK; i++)
                acc += w[i] * x[i];
            res[t] += acc;
        }
    }
}

MM_ROW_FNS(q6_rows_c, q6_row_c, )

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
            if (!(i & 63))
                _mm_prefetch((const char *)p + i + MM_PREFETCH, _MM_HINT_T0);
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
            if (!(i & 63))
                _mm_prefetch((const char *)p + i + MM_PREFETCH, _MM_HINT_T0);
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
        if (!(i & 63))
            _mm_prefetch((const char *)p + i + MM_PREFETCH, _MM_HINT_T0);
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
        if (!(i & 63))
            _mm_prefetch((const char *)p + i + MM_PREFETCH, _MM_HINT_T0);
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

/* int8 per block: per block, the codes' sums as above, then scaled by the block's scale into
 * one accumulator per input row (as the NF4 kernels do); blocksize a multiple of 32 (16). */
__attribute__((target("avx512f"), always_inline)) static inline void
i8b_row512(const mm_job *j, const uint8_t *p, const float *am, Py_ssize_t m0, int mt, float *res)
{
    Py_ssize_t bs = j->blocksize;
    __m512 acc[MM_TILE];
    for (int t = 0; t < mt; t++)
        acc[t] = _mm512_setzero_ps();
    for (Py_ssize_t b = 0; b < j->K / bs; b++) {
        __m512 s[MM_TILE], s2[MM_TILE];
        for (int t = 0; t < mt; t++)
            s[t] = s2[t] = _mm512_setzero_ps();
        for (Py_ssize_t i = b * bs; i < (b + 1) * bs; i += 32) {
            if (!(i & 63))
                _mm_prefetch((const char *)p + i + MM_PREFETCH, _MM_HINT_T0);
            __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + i))));
            __m512 w2 = _mm512_cvtepi32_ps(
                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + i + 16))));
            for (int t = 0; t < mt; t++) {
                const float *x = j->xe + (m0 + t) * j->K + i;
                s[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x), s[t]);
                s2[t] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(x + 16), s2[t]);
            }
        }
        __m512 a = _mm512_set1_ps(am[b]);
        for (int t = 0; t < mt; t++)
            acc[t] = _mm512_fmadd_ps(_mm512_add_ps(s[t], s2[t]), a, acc[t]);
    }
    for (int t = 0; t < mt; t++)
        res[t] = _mm512_reduce_add_ps(acc[t]);
}

__attribute__((target("avx2,fma"), always_inline)) static inline void
i8b_row256(const mm_job *j, const uint8_t *p, const float *am, Py_ssize_t m0, int mt, float *res)
{
    Py_ssize_t bs = j->blocksize;
    __m256 acc[MM_TILE];
    for (int t = 0; t < mt; t++)
        acc[t] = _mm256_setzero_ps();
    for (Py_ssize_t b = 0; b < j->K / bs; b++) {
        __m256 s[MM_TILE], s2[MM_TILE];
        for (int t = 0; t < mt; t++)
            s[t] = s2[t] = _mm256_setzero_ps();
        for (Py_ssize_t i = b * bs; i < (b + 1) * bs; i += 16) {
            if (!(i & 63))
                _mm_prefetch((const char *)p + i + MM_PREFETCH, _MM_HINT_T0);
            __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + i))));
            __m256 w2 = _mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + i + 8))));
            for (int t = 0; t < mt; t++) {
                const float *x = j->xe + (m0 + t) * j->K + i;
                s[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x), s[t]);
                s2[t] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 8), s2[t]);
            }
        }
        __m256 a = _mm256_set1_ps(am[b]);
        for (int t = 0; t < mt; t++)
            acc[t] = _mm256_fmadd_ps(_mm256_add_ps(s[t], s2[t]), a, acc[t]);
    }
    for (int t = 0; t < mt; t++)
        res[t] = hsum256(acc[t]);
}

/* Q8_0 rows: per block, the 32 codes widened to float32 and scaled by d once for the tile, then
 * two FMA chains per input row (the block's halves). AVX-512 takes tiles of up to 8 rows of x
 * (16 accumulators, of its 32 registers), AVX2 up to 4 (8 of its 16). These one-row kernels
 * take only a share's odd last row: the rest go two weight rows at a time (q8_pair512,
 * q8_pair256 below). */
__attribute__((target("avx512f"), always_inline)) static inline void
q8_row512(const mm_job *j, const uint8_t *p, const float *am, Py_ssize_t m0, int mt, float *res)
{
    Py_ssize_t bpr = j->K / Q8_BLOCK, K = j->K;
    const float *x0 = j->xe + m0 * K;
    __m512 s[Q8_TILE], s2[Q8_TILE];
    for (int t = 0; t < mt; t++)
        s[t] = s2[t] = _mm512_setzero_ps();
    for (Py_ssize_t b = 0; b < bpr; b++, p += Q8_BLOCK_BYTES) {
        _mm_prefetch((const char *)p + MM_PREFETCH, _MM_HINT_T0);
        __m512 d = _mm512_set1_ps(q8_scale(p));
        __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                     _mm_loadu_si128((const __m128i *)(p + 2)))), d);
        __m512 w2 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                      _mm_loadu_si128((const __m128i *)(p + 18)))), d);
        for (int t = 0; t < mt; t++) {
            const float *x = x0 + t * K + b * Q8_BLOCK;
            s[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x), s[t]);
            s2[t] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(x + 16), s2[t]);
        }
    }
    for (int t = 0; t < mt; t++)
        res[t] = _mm512_reduce_add_ps(_mm512_add_ps(s[t], s2[t]));
}

__attribute__((target("avx2,fma"), always_inline)) static inline void
q8_row256(const mm_job *j, const uint8_t *p, const float *am, Py_ssize_t m0, int mt, float *res)
{
    Py_ssize_t bpr = j->K / Q8_BLOCK, K = j->K;
    const float *x0 = j->xe + m0 * K;
    __m256 s[MM_TILE], s2[MM_TILE];
    for (int t = 0; t < mt; t++)
        s[t] = s2[t] = _mm256_setzero_ps();
    for (Py_ssize_t b = 0; b < bpr; b++, p += Q8_BLOCK_BYTES) {
        _mm_prefetch((const char *)p + MM_PREFETCH, _MM_HINT_T0);
        __m256 d = _mm256_set1_ps(q8_scale(p));
        for (int h = 0; h < Q8_BLOCK; h += 16) {
            __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                         _mm_loadl_epi64((const __m128i *)(p + 2 + h)))), d);
            __m256 w2 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                          _mm_loadl_epi64((const __m128i *)(p + 10 + h)))), d);
            for (int t = 0; t < mt; t++) {
                const float *x = x0 + t * K + b * Q8_BLOCK + h;
                s[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x), s[t]);
                s2[t] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 8), s2[t]);
            }
        }
    }
    for (int t = 0; t < mt; t++)
        res[t] = hsum256(_mm256_add_ps(s[t], s2[t]));
}

/* Q6_K: half h (0, 1) of a super-block as 4 x 32 signed codes q - 32, q[g] holding values
 * 32 g .. 32 g + 31 of the half (byte shifts as 16-bit shifts, the bits crossing bytes masked). */
__attribute__((target("avx2"), always_inline)) static inline void
q6_codes(const uint8_t *blk, int h, __m256i q[4])
{
    const uint8_t *ql = blk + 64 * h, *qh = blk + 128 + 32 * h;
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(0x30);
    const __m256i off = _mm256_set1_epi8(32);
    __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
    __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
    __m256i hh = _mm256_loadu_si256((const __m256i *)qh);
    __m256i lo0 = _mm256_and_si256(l0, m4), lo1 = _mm256_and_si256(l1, m4);
    __m256i hi0 = _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4);
    __m256i hi1 = _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4);
    q[0] = _mm256_or_si256(lo0, _mm256_and_si256(_mm256_slli_epi16(hh, 4), m2));
    q[1] = _mm256_or_si256(lo1, _mm256_and_si256(_mm256_slli_epi16(hh, 2), m2));
    q[2] = _mm256_or_si256(hi0, _mm256_and_si256(hh, m2));
    q[3] = _mm256_or_si256(hi1, _mm256_and_si256(_mm256_srli_epi16(hh, 2), m2));
    for (int g = 0; g < 4; g++)
        q[g] = _mm256_sub_epi8(q[g], off);
}

/* Q6_K rows: per group of 16 weights (one int8 scale) the codes widened to float32 and scaled
 * by d * scale once for the tile, then one FMA per row of x; two chains (a group's halves of
 * 32). AVX-512 takes tiles of up to 8 rows of x, AVX2 up to 4. */
__attribute__((target("avx512f"), always_inline)) static inline void
q6_row512(const mm_job *j, const uint8_t *p, const float *am, Py_ssize_t m0, int mt, float *res)
{
    Py_ssize_t bpr = j->K / Q6_BLOCK, K = j->K;
    const float *x0 = j->xe + m0 * K;
    __m512 s[Q8_TILE], s2[Q8_TILE];
    for (int t = 0; t < mt; t++)
        s[t] = s2[t] = _mm512_setzero_ps();
    for (Py_ssize_t b = 0; b < bpr; b++, p += Q6_BLOCK_BYTES) {
        for (int c = 0; c < Q6_BLOCK_BYTES; c += 64)
            _mm_prefetch((const char *)p + c + MM_PREFETCH, _MM_HINT_T0);
        float ds[16];
        q6_scales(p, ds);
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            q6_codes(p, h, q);
            for (int g = 0; g < 4; g++) {
                __m512 w = _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q[g]))),
                    _mm512_set1_ps(ds[8 * h + 2 * g]));
                __m512 w2 = _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q[g], 1))),
                    _mm512_set1_ps(ds[8 * h + 2 * g + 1]));
                for (int t = 0; t < mt; t++) {
                    const float *x = x0 + t * K + b * Q6_BLOCK + 128 * h + 32 * g;
                    s[t] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x), s[t]);
                    s2[t] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(x + 16), s2[t]);
                }
            }
        }
    }
    for (int t = 0; t < mt; t++)
        res[t] = _mm512_reduce_add_ps(_mm512_add_ps(s[t], s2[t]));
}

__attribute__((target("avx2,fma"), always_inline)) static inline void
q6_row256(const mm_job *j, const uint8_t *p, const float *am, Py_ssize_t m0, int mt, float *res)
{
    Py_ssize_t bpr = j->K / Q6_BLOCK, K = j->K;
    const float *x0 = j->xe + m0 * K;
    __m256 s[MM_TILE], s2[MM_TILE];
    for (int t = 0; t < mt; t++)
        s[t] = s2[t] = _mm256_setzero_ps();
    for (Py_ssize_t b = 0; b < bpr; b++, p += Q6_BLOCK_BYTES) {
        for (int c = 0; c < Q6_BLOCK_BYTES; c += 64)
            _mm_prefetch((const char *)p + c + MM_PREFETCH, _MM_HINT_T0);
        float ds[16];
        q6_scales(p, ds);
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            q6_codes(p, h, q);
            for (int g = 0; g < 8; g++) {  /* 16 weights, one scale */
                __m128i v = g & 1 ? _mm256_extracti128_si256(q[g / 2], 1)
                                  : _mm256_castsi256_si128(q[g / 2]);
                __m256 dv = _mm256_broadcast_ss(ds + 8 * h + g);
                __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), dv);
                __m256 w2 = _mm256_mul_ps(
                    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v))), dv);
                for (int t = 0; t < mt; t++) {
                    const float *x = x0 + t * K + b * Q6_BLOCK + 128 * h + 16 * g;
                    s[t] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x), s[t]);
                    s2[t] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 8), s2[t]);
                }
            }
        }
    }
    for (int t = 0; t < mt; t++)
        res[t] = hsum256(_mm256_add_ps(s[t], s2[t]));
}

/* Two weight rows (p and the next row) against up to Q8_TILE rows of x: each x vector is loaded
 * once for both, halving what a tile reads from cache per weight row. Up to 4 rows of x, each
 * pair (x row, weight row) keeps two FMA chains (the block's halves); above, one. res holds the
 * first weight row's sums at [0, mt) and the second's at [Q8_TILE, Q8_TILE + mt). */
__attribute__((target("avx512f"), always_inline)) static inline void
q8_pair512(const mm_job *j, const uint8_t *p, Py_ssize_t m0, int mt, float *res)
{
    Py_ssize_t bpr = j->K / Q8_BLOCK, K = j->K;
    const uint8_t *p1 = p + bpr * Q8_BLOCK_BYTES;
    const float *x0 = j->xe + m0 * K;
    const int split = mt <= 4;
    __m512 s[Q8_TILE], s1[Q8_TILE], u[Q8_TILE], u1[Q8_TILE];
    for (int t = 0; t < mt; t++)
        s[t] = s1[t] = u[t] = u1[t] = _mm512_setzero_ps();
    for (Py_ssize_t b = 0; b < bpr; b++, p += Q8_BLOCK_BYTES, p1 += Q8_BLOCK_BYTES) {
        _mm_prefetch((const char *)p + MM_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)p1 + MM_PREFETCH, _MM_HINT_T0);
        __m512 d0 = _mm512_set1_ps(q8_scale(p)), d1 = _mm512_set1_ps(q8_scale(p1));
        __m512 a0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                      _mm_loadu_si128((const __m128i *)(p + 2)))), d0);
        __m512 b0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                      _mm_loadu_si128((const __m128i *)(p + 18)))), d0);
        __m512 a1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                      _mm_loadu_si128((const __m128i *)(p1 + 2)))), d1);
        __m512 b1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                      _mm_loadu_si128((const __m128i *)(p1 + 18)))), d1);
        for (int t = 0; t < mt; t++) {
            const float *x = x0 + t * K + b * Q8_BLOCK;
            __m512 xa = _mm512_loadu_ps(x), xb = _mm512_loadu_ps(x + 16);
            s[t] = _mm512_fmadd_ps(a0, xa, s[t]);
            s1[t] = _mm512_fmadd_ps(a1, xa, s1[t]);
            if (split) {
                u[t] = _mm512_fmadd_ps(b0, xb, u[t]);
                u1[t] = _mm512_fmadd_ps(b1, xb, u1[t]);
            } else {
                s[t] = _mm512_fmadd_ps(b0, xb, s[t]);
                s1[t] = _mm512_fmadd_ps(b1, xb, s1[t]);
            }
        }
    }
    for (int t = 0; t < mt; t++) {
        res[t] = _mm512_reduce_add_ps(split ? _mm512_add_ps(s[t], u[t]) : s[t]);
        res[Q8_TILE + t] = _mm512_reduce_add_ps(split ? _mm512_add_ps(s1[t], u1[t]) : s1[t]);
    }
}

/* The same at 8 lanes, up to 4 rows of x: two chains per (x row, weight row) up to 2 rows, one
 * above (8 accumulators, 4 weight vectors and 2 scales of AVX2's 16 registers). */
__attribute__((target("avx2,fma"), always_inline)) static inline void
q8_pair256(const mm_job *j, const uint8_t *p, Py_ssize_t m0, int mt, float *res)
{
    Py_ssize_t bpr = j->K / Q8_BLOCK, K = j->K;
    const uint8_t *p1 = p + bpr * Q8_BLOCK_BYTES;
    const float *x0 = j->xe + m0 * K;
    const int split = mt <= 2;
    __m256 s[MM_TILE], s1[MM_TILE], u[MM_TILE], u1[MM_TILE];
    for (int t = 0; t < mt; t++)
        s[t] = s1[t] = u[t] = u1[t] = _mm256_setzero_ps();
    for (Py_ssize_t b = 0; b < bpr; b++, p += Q8_BLOCK_BYTES, p1 += Q8_BLOCK_BYTES) {
        _mm_prefetch((const char *)p + MM_PREFETCH, _MM_HINT_T0);
        _mm_prefetch((const char *)p1 + MM_PREFETCH, _MM_HINT_T0);
        __m256 d0 = _mm256_set1_ps(q8_scale(p)), d1 = _mm256_set1_ps(q8_scale(p1));
        for (int h = 0; h < Q8_BLOCK; h += 16) {
            __m256 a0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                          _mm_loadl_epi64((const __m128i *)(p + 2 + h)))), d0);
            __m256 b0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                          _mm_loadl_epi64((const __m128i *)(p + 10 + h)))), d0);
            __m256 a1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                          _mm_loadl_epi64((const __m128i *)(p1 + 2 + h)))), d1);
            __m256 b1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                          _mm_loadl_epi64((const __m128i *)(p1 + 10 + h)))), d1);
            for (int t = 0; t < mt; t++) {
                const float *x = x0 + t * K + b * Q8_BLOCK + h;
                __m256 xa = _mm256_loadu_ps(x), xb = _mm256_loadu_ps(x + 8);
                s[t] = _mm256_fmadd_ps(a0, xa, s[t]);
                s1[t] = _mm256_fmadd_ps(a1, xa, s1[t]);
                if (split) {
                    u[t] = _mm256_fmadd_ps(b0, xb, u[t]);
                    u1[t] = _mm256_fmadd_ps(b1, xb, u1[t]);
                } else {
                    s[t] = _mm256_fmadd_ps(b0, xb, s[t]);
                    s1[t] = _mm256_fmadd_ps(b1, xb, s1[t]);
                }
            }
        }
    }
    for (int t = 0; t < mt; t++) {
        res[t] = hsum256(split ? _mm256_add_ps(s[t], u[t]) : s[t]);
        res[Q8_TILE + t] = hsum256(split ? _mm256_add_ps(s1[t], u1[t]) : s1[t]);
    }
}

/* Pair kernels in the row kernels' signature (am unused), one per tile size. */
#define Q8_PAIR_FN(PREFIX, KERNEL, TARGET, T)                                                 \
    TARGET static void PREFIX##_##T(const mm_job *j, const uint8_t *p, const float *am,        \
                                    Py_ssize_t m0, float *res)                                 \
    {                                                                                          \
        KERNEL(j, p, m0, T, res);                                                              \
    }
Q8_PAIR_FN(q8_pairs_avx512, q8_pair512, __attribute__((target("avx512f"))), 1)
Q8_PAIR_FN(q8_pairs_avx512, q8_pair512, __attribute__((target("avx512f"))), 2)
Q8_PAIR_FN(q8_pairs_avx512, q8_pair512, __attribute__((target("avx512f"))), 3)
Q8_PAIR_FN(q8_pairs_avx512, q8_pair512, __attribute__((target("avx512f"))), 4)
Q8_PAIR_FN(q8_pairs_avx512, q8_pair512, __attribute__((target("avx512f"))), 5)
Q8_PAIR_FN(q8_pairs_avx512, q8_pair512, __attribute__((target("avx512f"))), 6)
Q8_PAIR_FN(q8_pairs_avx512, q8_pair512, __attribute__((target("avx512f"))), 7)
Q8_PAIR_FN(q8_pairs_avx512, q8_pair512, __attribute__((target("avx512f"))), 8)
Q8_PAIR_FN(q8_pairs_avx2, q8_pair256, __attribute__((target("avx2,fma"))), 1)
Q8_PAIR_FN(q8_pairs_avx2, q8_pair256, __attribute__((target("avx2,fma"))), 2)
Q8_PAIR_FN(q8_pairs_avx2, q8_pair256, __attribute__((target("avx2,fma"))), 3)
Q8_PAIR_FN(q8_pairs_avx2, q8_pair256, __attribute__((target("avx2,fma"))), 4)
static const mm_row_fn q8_pairs_avx512[Q8_TILE] = {
    q8_pairs_avx512_1, q8_pairs_avx512_2, q8_pairs_avx512_3, q8_pairs_avx512_4,
    q8_pairs_avx512_5, q8_pairs_avx512_6, q8_pairs_avx512_7, q8_pairs_avx512_8};
static const mm_row_fn q8_pairs_avx2[MM_TILE] = {q8_pairs_avx2_1, q8_pairs_avx2_2,
                                                 q8_pairs_avx2_3, q8_pairs_avx2_4};

#define MM_ROW_FNS8(PREFIX, KERNEL, TARGET)                                                   \
    MM_ROW_FN(PREFIX, KERNEL, TARGET, 1)                                                      \
    MM_ROW_FN(PREFIX, KERNEL, TARGET, 2)                                                      \
    MM_ROW_FN(PREFIX, KERNEL, TARGET, 3)                                                      \
    MM_ROW_FN(PREFIX, KERNEL, TARGET, 4)                                                      \
    MM_ROW_FN(PREFIX, KERNEL, TARGET, 5)                                                      \
    MM_ROW_FN(PREFIX, KERNEL, TARGET, 6)                                                      \
    MM_ROW_FN(PREFIX, KERNEL, TARGET, 7)                                                      \
    MM_ROW_FN(PREFIX, KERNEL, TARGET, 8)                                                      \
    static const mm_row_fn PREFIX[Q8_TILE] = {PREFIX##_1, PREFIX##_2, PREFIX##_3, PREFIX##_4, \
                                              PREFIX##_5, PREFIX##_6, PREFIX##_7, PREFIX##_8};

MM_ROW_FNS8(q8_rows_avx512, q8_row512, __attribute__((target("avx512f"))))
MM_ROW_FNS8(q6_rows_avx512, q6_row512, __attribute__((target("avx512f"))))
MM_ROW_FNS(q6_rows_avx2, q6_row256, __attribute__((target("avx2,fma"))))
MM_ROW_FNS(q8_rows_avx2, q8_row256, __attribute__((target("avx2,fma"))))
MM_ROW_FNS(i8_rows_avx512, i8_row512, __attribute__((target("avx512f"))))
MM_ROW_FNS(i8_rows_avx2, i8_row256, __attribute__((target("avx2,fma"))))
MM_ROW_FNS(i8b_rows_avx512, i8b_row512, __attribute__((target("avx512f"))))
MM_ROW_FNS(i8b_rows_avx2, i8b_row256, __attribute__((target("avx2,fma"))))
MM_ROW_FNS(mm_rows_avx512, mm_row512, __attribute__((target("avx512f"))))
MM_ROW_FNS(mm_rows_avx2, mm_row256, __attribute__((target("avx2,fma"))))
#endif

/* Every output row of the job's share, input rows in tiles of up to `tile` (rows[] has one
 * kernel per tile size 1..tile). */
static void mm_rows(const mm_job *j, const mm_row_fn *rows, int tile)
{
    /* NF4: K/2 code bytes and K/blocksize absmax per row; int8: K codes and K/blocksize
     * scales (one per row: the kernel's sum scaled here); Q8_0: K/32 blocks of 34 bytes, Q6_K:
     * K/256 blocks of 210, their scales inside. */
    Py_ssize_t stride = j->codes == MM_INT8   ? j->K
                        : j->codes == MM_Q8_0 ? j->K / Q8_BLOCK * Q8_BLOCK_BYTES
                        : j->codes == MM_Q6_K ? j->K / Q6_BLOCK * Q6_BLOCK_BYTES
                                              : j->K / 2;
    Py_ssize_t bpr = j->codes == MM_INT8 || j->codes == MM_NF4 ? j->K / j->blocksize : 0;
    float res[Q8_TILE];
    for (Py_ssize_t n = j->n0; n < j->n1; n++) {
        const uint8_t *p = j->packed + n * stride;
        const float *am = bpr ? j->absmax + n * bpr : NULL;
        float scale = j->codes == MM_INT8 && bpr == 1 ? am[0] : 1.0f;
        for (Py_ssize_t m0 = 0; m0 < j->M; m0 += tile) {
            int mt = j->M - m0 < tile ? (int)(j->M - m0) : tile;
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
    if (found == ISA_AVX512 && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
        && __builtin_cpu_supports("avx512bf16"))
        found = ISA_AVX512BF16;
#endif
    const char *cap = getenv("LCT_NATIVE_ISA");
    if (cap && !strcmp(cap, "scalar"))
        found = ISA_SCALAR;
    else if (cap && !strcmp(cap, "avx2") && found > ISA_AVX2)
        found = ISA_AVX2;
    else if (cap && !strcmp(cap, "avx512") && found > ISA_AVX512)
        found = ISA_AVX512;
    return isa = found;
}

/* The step (in packed bytes) an instruction set's loop takes; a block must hold whole steps. */
static Py_ssize_t isa_step(int isa)
{
    return isa >= ISA_AVX512 ? 16 : isa == ISA_AVX2 ? 8 : 1;
}

#ifdef LCT_X86
/* Q8_0's vector loops: the job's output rows two at a time (pairs[]), a last odd one alone
 * (rows[]); input rows in tiles of up to `tile` (both tables have one kernel per tile size). */
static void q8_rows_paired(const mm_job *j, const mm_row_fn *pairs, const mm_row_fn *rows,
                           int tile)
{
    Py_ssize_t stride = j->K / Q8_BLOCK * Q8_BLOCK_BYTES;
    float res[2 * Q8_TILE];
    Py_ssize_t n = j->n0;
    for (; n + 1 < j->n1; n += 2) {
        const uint8_t *p = j->packed + n * stride;
        for (Py_ssize_t m0 = 0; m0 < j->M; m0 += tile) {
            int mt = j->M - m0 < tile ? (int)(j->M - m0) : tile;
            pairs[mt - 1](j, p, NULL, m0, res);
            for (int t = 0; t < mt; t++) {
                mm_store(j, m0 + t, n, res[t]);
                mm_store(j, m0 + t, n + 1, res[Q8_TILE + t]);
            }
        }
    }
    if (n < j->n1) {
        mm_job one = *j;
        one.n0 = n;
        mm_rows(&one, rows, tile);
    }
}
#endif

static void *mm_worker(void *arg)
{
    const mm_job *j = arg;
#ifdef LCT_X86
    if (j->isa >= ISA_AVX512) {
        if (j->codes == MM_Q8_0)
            q8_rows_paired(j, q8_pairs_avx512, q8_rows_avx512, Q8_TILE);
        else if (j->codes == MM_Q6_K)
            mm_rows(j, q6_rows_avx512, Q8_TILE);
        else
            mm_rows(j, j->codes != MM_INT8 ? mm_rows_avx512
                       : j->blocksize == j->K ? i8_rows_avx512 : i8b_rows_avx512, MM_TILE);
        return NULL;
    }
    if (j->isa == ISA_AVX2) {
        if (j->codes == MM_Q8_0)
            q8_rows_paired(j, q8_pairs_avx2, q8_rows_avx2, MM_TILE);
        else if (j->codes == MM_Q6_K)
            mm_rows(j, q6_rows_avx2, MM_TILE);
        else
            mm_rows(j, j->codes != MM_INT8 ? mm_rows_avx2
                       : j->blocksize == j->K ? i8_rows_avx2 : i8b_rows_avx2, MM_TILE);
        return NULL;
    }
#endif
    mm_rows(j, j->codes == MM_Q8_0 ? q8_rows_c : j->codes == MM_Q6_K ? q6_rows_c
               : j->codes != MM_INT8 ? mm_rows_c : j->blocksize == j->K ? i8_rows_c : i8b_rows_c,
            MM_TILE);
    return NULL;
}

/* Run `threads` jobs (`size` bytes each, output rows split evenly) through `worker`, thread 0's
 * share on the calling thread; a share whose thread cannot be started runs here too. Call with
 * the GIL released. */
static void run_jobs(void *(*worker)(void *), void *jobs, size_t size, pthread_t *tids,
                     int threads)
{
    char started[64] = {0};
    for (int t = 1; t < threads; t++) {
        void *job = (char *)jobs + t * size;
        started[t] = pthread_create(&tids[t], NULL, worker, job) == 0;
        if (!started[t])
            worker(job);
    }
    worker(jobs);
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

#include "_tiled.h"

static PyObject *nf4_matmul_isa(PyObject *self, PyObject *args)
{
    static const char *names[] = {"scalar", "avx2", "avx512", "avx512bf16"};
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
                             blocksize, N * t / threads, N * (t + 1) / threads, out_kind, isa,
                             MM_NF4};
                jobs[t] = jb;
            }
            run_jobs(mm_worker, jobs, sizeof(mm_job), tids, threads);
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

/* The int8 and Q8_0 matmuls' run, once their buffers are checked: x widened to float32 (from
 * bfloat16 bits when x_kind is 1), N split over `threads` jobs, the GIL released meanwhile.
 * Returns Py_None, or NULL with MemoryError set. */
static PyObject *mm_run_widened(const void *codes, const float *scales, const void *x, int x_kind,
                                void *out, int out_kind, Py_ssize_t M, Py_ssize_t N, Py_ssize_t K,
                                Py_ssize_t blocksize, int threads, int isa, int kind)
{
    float *xf = malloc((size_t)M * K * sizeof(float));
    mm_job *jobs = malloc((size_t)threads * sizeof(mm_job));
    pthread_t *tids = malloc((size_t)threads * sizeof(pthread_t));
    if (!xf || !jobs || !tids) {
        free(xf);
        free(jobs);
        free(tids);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < M * K; i++) {
        if (x_kind == 0) {
            xf[i] = ((const float *)x)[i];
        } else {
            uint32_t u = (uint32_t)((const uint16_t *)x)[i] << 16;
            memcpy(&xf[i], &u, 4);
        }
    }
    for (int t = 0; t < threads; t++) {
        mm_job jb = {codes, scales, NULL, xf, NULL, out, M, N, K, blocksize,
                     N * t / threads, N * (t + 1) / threads, out_kind, isa, kind};
        jobs[t] = jb;
    }
    run_jobs(mm_worker, jobs, sizeof(mm_job), tids, threads);
    Py_END_ALLOW_THREADS
    free(xf);
    free(jobs);
    free(tids);
    return Py_NewRef(Py_None);
}

/* out[M, N] = x[M, K] @ W.T with q int8 [N, K] and one float32 scale per `blocksize` codes of a
 * row (blocksize K: one per row), W = q * scale. */
static PyObject *int8_matmul(PyObject *self, PyObject *args)
{
    Py_buffer x, q, scale, out;
    Py_ssize_t M, N, K, bs;
    int x_kind, out_kind, threads, isa;
    if (!PyArg_ParseTuple(args, "y*iy*y*w*innnnii", &x, &x_kind, &q, &scale, &out, &out_kind, &M,
                          &N, &K, &bs, &threads, &isa))
        return NULL;
    PyObject *ret = NULL;
    Py_ssize_t xs = x_kind == 0 ? 4 : 2, os = out_kind == 0 ? 4 : 2;
    if (isa < 0 || isa > best_isa())
        isa = best_isa();
    if ((x_kind != 0 && x_kind != 1) || (out_kind != 0 && out_kind != 1)) {
        PyErr_SetString(PyExc_ValueError, "int8_matmul: kinds must be 0 (float32) or 1 (bfloat16)");
    } else if (M <= 0 || N <= 0 || K <= 0 || M > PY_SSIZE_T_MAX / K || N > PY_SSIZE_T_MAX / K
               || M > PY_SSIZE_T_MAX / N || bs <= 0 || K % bs) {
        PyErr_Format(PyExc_ValueError, "int8_matmul: bad shape M=%zd N=%zd K=%zd blocksize=%zd",
                     M, N, K, bs);
    } else if (x.len != M * K * xs || q.len != N * K || scale.len != N * (K / bs) * 4
               || out.len != M * N * os) {
        PyErr_Format(PyExc_ValueError, "int8_matmul: buffer sizes %zd/%zd/%zd/%zd do not match "
                     "M=%zd N=%zd K=%zd", x.len, q.len, scale.len, out.len, M, N, K);
    } else if (((uintptr_t)x.buf) % xs || ((uintptr_t)out.buf) % os || ((uintptr_t)scale.buf) % 4) {
        PyErr_SetString(PyExc_ValueError, "int8_matmul: a buffer is not aligned");
    } else {
        threads = mm_threads(threads, N);
        if (bs % (2 * 16))     /* the vector loops take 32 (AVX-512) or 16 (AVX2) codes a step */
            isa = bs % 16 ? ISA_SCALAR : (isa >= ISA_AVX512 ? ISA_AVX2 : isa);
        ret = mm_run_widened(q.buf, scale.buf, x.buf, x_kind, out.buf, out_kind, M, N, K, bs,
                             threads, isa, MM_INT8);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&q);
    PyBuffer_Release(&scale);
    PyBuffer_Release(&out);
    return ret;
}

/* out[M, N] = x[M, K] @ W.T with W [N, K] in Q8_0: `blocks` holds N * K/32 blocks of 34 bytes,
 * row-major (a row's K/32 blocks contiguous), each a little-endian float16 d and 32 int8 q. */
static PyObject *q8_0_matmul(PyObject *self, PyObject *args)
{
    Py_buffer x, blocks, out;
    Py_ssize_t M, N, K;
    int x_kind, out_kind, threads, isa;
    if (!PyArg_ParseTuple(args, "y*iy*w*innnii", &x, &x_kind, &blocks, &out, &out_kind, &M, &N,
                          &K, &threads, &isa))
        return NULL;
    PyObject *ret = NULL;
    Py_ssize_t xs = x_kind == 0 ? 4 : 2, os = out_kind == 0 ? 4 : 2;
    if (isa < 0 || isa > best_isa())
        isa = best_isa();
    if ((x_kind != 0 && x_kind != 1) || (out_kind != 0 && out_kind != 1)) {
        PyErr_SetString(PyExc_ValueError, "q8_0_matmul: kinds must be 0 (float32) or 1 (bfloat16)");
    } else if (M <= 0 || N <= 0 || K <= 0 || K % Q8_BLOCK || M > PY_SSIZE_T_MAX / K
               || N > PY_SSIZE_T_MAX / K || M > PY_SSIZE_T_MAX / N) {
        PyErr_Format(PyExc_ValueError, "q8_0_matmul: bad shape M=%zd N=%zd K=%zd (positive, K a "
                     "multiple of 32)", M, N, K);
    } else if (x.len != M * K * xs || blocks.len / Q8_BLOCK_BYTES != N * (K / Q8_BLOCK)
               || blocks.len % Q8_BLOCK_BYTES || out.len != M * N * os) {
        PyErr_Format(PyExc_ValueError, "q8_0_matmul: buffer sizes %zd/%zd/%zd do not match "
                     "M=%zd N=%zd K=%zd", x.len, blocks.len, out.len, M, N, K);
    } else if (((uintptr_t)x.buf) % xs || ((uintptr_t)out.buf) % os) {
        PyErr_SetString(PyExc_ValueError, "q8_0_matmul: a buffer is not aligned");
    } else {
        threads = mm_threads(threads, N);
        ret = mm_run_widened(blocks.buf, NULL, x.buf, x_kind, out.buf, out_kind, M, N, K,
                             Q8_BLOCK, threads, isa, MM_Q8_0);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&blocks);
    PyBuffer_Release(&out);
    return ret;
}

/* out[M, N] = x[M, K] @ W.T with W [N, K] in Q6_K: `blocks` holds N * K/256 blocks of 210 bytes,
 * row-major, each ql[128], qh[64], 16 int8 scales and a little-endian float16 d. */
static PyObject *q6_k_matmul(PyObject *self, PyObject *args)
{
    Py_buffer x, blocks, out;
    Py_ssize_t M, N, K;
    int x_kind, out_kind, threads, isa;
    if (!PyArg_ParseTuple(args, "y*iy*w*innnii", &x, &x_kind, &blocks, &out, &out_kind, &M, &N,
                          &K, &threads, &isa))
        return NULL;
    PyObject *ret = NULL;
    Py_ssize_t xs = x_kind == 0 ? 4 : 2, os = out_kind == 0 ? 4 : 2;
    if (isa < 0 || isa > best_isa())
        isa = best_isa();
    if ((x_kind != 0 && x_kind != 1) || (out_kind != 0 && out_kind != 1)) {
        PyErr_SetString(PyExc_ValueError,
                        "q6_k_matmul: kinds must be 0 (float32) or 1 (bfloat16)");
    } else if (M <= 0 || N <= 0 || K <= 0 || K % Q6_BLOCK || M > PY_SSIZE_T_MAX / K
               || N > PY_SSIZE_T_MAX / K || M > PY_SSIZE_T_MAX / N) {
        PyErr_Format(PyExc_ValueError, "q6_k_matmul: bad shape M=%zd N=%zd K=%zd (positive, K a "
                     "multiple of 256)", M, N, K);
    } else if (x.len != M * K * xs || blocks.len / Q6_BLOCK_BYTES != N * (K / Q6_BLOCK)
               || blocks.len % Q6_BLOCK_BYTES || out.len != M * N * os) {
        PyErr_Format(PyExc_ValueError, "q6_k_matmul: buffer sizes %zd/%zd/%zd do not match "
                     "M=%zd N=%zd K=%zd", x.len, blocks.len, out.len, M, N, K);
    } else if (((uintptr_t)x.buf) % xs || ((uintptr_t)out.buf) % os) {
        PyErr_SetString(PyExc_ValueError, "q6_k_matmul: a buffer is not aligned");
    } else {
        threads = mm_threads(threads, N);
        ret = mm_run_widened(blocks.buf, NULL, x.buf, x_kind, out.buf, out_kind, M, N, K,
                             Q6_BLOCK, threads, isa, MM_Q6_K);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&blocks);
    PyBuffer_Release(&out);
    return ret;
}

/* 64-byte aligned, zeroed memory of at least `size` bytes (NULL when out of memory). */
static void *zalloc64(size_t size)
{
    size = (size + 63) & ~(size_t)63;
    void *p = aligned_alloc(64, size ? size : 64);
    if (p)
        memset(p, 0, size);
    return p;
}

/* The tiled matmul's run once its buffers are checked: x copied into zero-padded rows of Kp
 * (bfloat16 kept, or widened to float32), a tile buffer per thread, the tiles taken in turn.
 * Returns Py_None, or NULL with MemoryError set. */
static PyObject *tl_run(tl_job proto, const void *x, int x_kind, int threads)
{
    Py_ssize_t M = proto.M, K = proto.K, Kp = proto.Kp;
    size_t esz = proto.bf16 ? 2 : 4;
    void *xp = zalloc64((size_t)M * Kp * esz);
    tl_job *jobs = calloc((size_t)threads, sizeof(tl_job));
    pthread_t *tids = malloc((size_t)threads * sizeof(pthread_t));
    Py_ssize_t next_tile = 0;
    int ok = xp && jobs && tids;
    for (int t = 0; ok && t < threads; t++) {
        jobs[t] = proto;
        jobs[t].x = xp;
        jobs[t].next_tile = &next_tile;
        jobs[t].tile = zalloc64((size_t)TL_ROWS * Kp * esz);
        jobs[t].row = zalloc64((size_t)Kp * sizeof(float));
        ok = jobs[t].tile && jobs[t].row;
    }
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t m = 0; m < M; m++)
            for (Py_ssize_t k = 0; k < K; k++) {
                Py_ssize_t i = m * K + k, o = m * Kp + k;
                if (proto.bf16) {
                    ((uint16_t *)xp)[o] = ((const uint16_t *)x)[i];
                } else if (x_kind == 0) {
                    ((float *)xp)[o] = ((const float *)x)[i];
                } else {
                    uint32_t u = (uint32_t)((const uint16_t *)x)[i] << 16;
                    memcpy((float *)xp + o, &u, 4);
                }
            }
        run_jobs(tl_worker, jobs, sizeof(tl_job), tids, threads);
        Py_END_ALLOW_THREADS
    }
    for (int t = 0; jobs && t < threads; t++) {
        free(jobs[t].tile);
        free(jobs[t].row);
    }
    free(xp);
    free(jobs);
    free(tids);
    return ok ? Py_NewRef(Py_None) : PyErr_NoMemory();
}

/* out[M, N] = x[M, K] @ W.T through tiles (kernels/_tiled.h) with W [N, K] of `kind`: TL_NF4
 * (codes [N, K/2], scales the float32 absmax [N, K/blocksize], table the 16 float32 levels),
 * TL_INT8 (codes [N, K] int8, scales [N, K/blocksize]: blocksize K is one per row, else a multiple
 * of 32), TL_Q8_0 or TL_Q6_K (codes the rows' blocks; scales
 * and table empty). w_bf16: the weights may be rounded to bfloat16 (taken when x is bfloat16 and
 * the CPU has AVX512_BF16). */
static PyObject *tiled_matmul(PyObject *self, PyObject *args)
{
    Py_buffer x, codes, scales, table, out;
    Py_ssize_t M, N, K, blocksize;
    int kind, x_kind, out_kind, w_bf16, threads, isa;
    if (!PyArg_ParseTuple(args, "iy*iy*y*y*w*innnnpii", &kind, &x, &x_kind, &codes, &scales,
                          &table, &out, &out_kind, &M, &N, &K, &blocksize, &w_bf16, &threads,
                          &isa))
        return NULL;
    PyObject *ret = NULL;
    Py_ssize_t xs = x_kind == 0 ? 4 : 2, os = out_kind == 0 ? 4 : 2, stride = 0, nscales = 0;
    int shape_ok = M > 0 && N > 0 && K > 0 && M <= PY_SSIZE_T_MAX / (K + TL_KALIGN) / 4
                   && N <= PY_SSIZE_T_MAX / K && M <= PY_SSIZE_T_MAX / N / 4;
    if (shape_ok && kind == TL_NF4) {
        shape_ok = blocksize > 0 && blocksize % 2 == 0 && K % blocksize == 0;
        stride = K / 2;
        nscales = shape_ok ? N * (K / blocksize) : 0;
    } else if (shape_ok && kind == TL_INT8) {
        shape_ok = blocksize > 0 && K % blocksize == 0
                   && (blocksize == K || blocksize % TL_KALIGN == 0);
        stride = K;
        nscales = shape_ok ? N * (K / blocksize) : 0;
    } else if (shape_ok && kind == TL_Q8_0) {
        shape_ok = K % Q8_BLOCK == 0 && N <= PY_SSIZE_T_MAX / (K / Q8_BLOCK * Q8_BLOCK_BYTES);
        stride = K / Q8_BLOCK * Q8_BLOCK_BYTES;
    } else if (shape_ok && kind == TL_Q6_K) {
        shape_ok = K % Q6_BLOCK == 0;
        stride = K / Q6_BLOCK * Q6_BLOCK_BYTES;
    }
    if (isa < 0 || isa > best_isa())
        isa = best_isa();
    if ((x_kind != 0 && x_kind != 1) || (out_kind != 0 && out_kind != 1)) {
        PyErr_SetString(PyExc_ValueError,
                        "tiled_matmul: kinds must be 0 (float32) or 1 (bfloat16)");
    } else if (kind < TL_NF4 || kind > TL_Q6_K) {
        PyErr_Format(PyExc_ValueError, "tiled_matmul: unknown weight kind %d (0 NF4, 1 int8, "
                     "2 Q8_0, 3 Q6_K)", kind);
    } else if (!shape_ok) {
        PyErr_Format(PyExc_ValueError, "tiled_matmul: bad shape M=%zd N=%zd K=%zd blocksize=%zd "
                     "for kind %d", M, N, K, blocksize, kind);
    } else if (x.len != M * K * xs || codes.len != N * stride || scales.len != nscales * 4
               || table.len != (kind == TL_NF4 ? 16 * 4 : 0) || out.len != M * N * os) {
        PyErr_Format(PyExc_ValueError, "tiled_matmul: buffer sizes %zd/%zd/%zd/%zd/%zd do not "
                     "match M=%zd N=%zd K=%zd for kind %d", x.len, codes.len, scales.len,
                     table.len, out.len, M, N, K, kind);
    } else if (((uintptr_t)x.buf) % xs || ((uintptr_t)out.buf) % os
               || ((uintptr_t)scales.buf) % 4 || ((uintptr_t)table.buf) % 4) {
        PyErr_SetString(PyExc_ValueError, "tiled_matmul: a buffer is not aligned");
    } else {
        isa = tl_isa(isa);
        int bf16 = w_bf16 && x_kind == 1 && isa >= ISA_AVX512BF16;
        tl_job proto = {kind, bf16, isa, out_kind, codes.buf, scales.buf, table.buf,
                        blocksize, M, N, K, (K + TL_KALIGN - 1) / TL_KALIGN * TL_KALIGN, stride,
                        NULL, NULL, out.buf, NULL, NULL, 1, 1};
        ret = tl_run(proto, x.buf, x_kind, mm_threads(threads, (N + TL_ROWS - 1) / TL_ROWS));
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&scales);
    PyBuffer_Release(&table);
    PyBuffer_Release(&out);
    return ret;
}

static PyMethodDef methods[] = {
    {"nf4_matmul", nf4_matmul, METH_VARARGS,
     "nf4_matmul(x, x_kind, packed, absmax, code, out, out_kind, M, N, K, blocksize, threads, "
     "isa): fused NF4 matmul, out[M, N] = x[M, K] @ W.T; isa -1 picks the best."},
    {"int8_matmul", int8_matmul, METH_VARARGS,
     "int8_matmul(x, x_kind, q, scale, out, out_kind, M, N, K, blocksize, threads, isa): fused "
     "int8 matmul, out[M, N] = x[M, K] @ (q * scale).T, a scale per blocksize codes of a row; "
     "isa -1 picks the best."},
    {"q8_0_matmul", q8_0_matmul, METH_VARARGS,
     "q8_0_matmul(x, x_kind, blocks, out, out_kind, M, N, K, threads, isa): fused Q8_0 matmul, "
     "out[M, N] = x[M, K] @ W.T with W in llama.cpp's Q8_0 blocks; isa -1 picks the best."},
    {"q6_k_matmul", q6_k_matmul, METH_VARARGS,
     "q6_k_matmul(x, x_kind, blocks, out, out_kind, M, N, K, threads, isa): fused Q6_K matmul, "
     "out[M, N] = x[M, K] @ W.T with W in llama.cpp's Q6_K blocks; isa -1 picks the best."},
    {"tiled_matmul", tiled_matmul, METH_VARARGS,
     "tiled_matmul(kind, x, x_kind, codes, scales, table, out, out_kind, M, N, K, blocksize, "
     "w_bf16, threads, isa): out[M, N] = x[M, K] @ W.T for many rows of x, W of kind 0 NF4, "
     "1 int8, 2 Q8_0 or 3 Q6_K dequantized a tile at a time; isa -1 picks the best."},
    {"nf4_matmul_isa", nf4_matmul_isa, METH_NOARGS,
     "The instruction set the matmuls use here: scalar, avx2, avx512 or avx512bf16."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "lct.kernels._native",
    "LCT's CPU matmuls over NF4, int8, Q8_0 and Q6_K weights (see kernels/native.py).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    for (uint32_t h = 0; h < 65536; h++)
        f16_table[h] = f16_to_f32((uint16_t)h);
    return PyModule_Create(&module);
}
