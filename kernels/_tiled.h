/* The tiled matmul of lct.kernels._native (included once, by kernels/_native.c, after its fused
 * kernels, whose helpers it shares: to_bf16, f16_table, q8_scale, q6_d, q6_block_c, q6_codes,
 * q6_scales, lookup16, the ISA levels).
 *
 * out[M, N] = x[M, K] @ W.T for many rows of x, W [N, K] in NF4, int8 (per row or per block of
 * a row), Q8_0 or Q6_K.
 * Threads take tiles of TL_ROWS rows of W from a shared counter, one ahead of the tile they
 * multiply, so a thread slowed by another process on its core does not hold up the rest. A tile
 * is dequantized once into a buffer that stays in L2 (tl_group512 at 16 lanes, four rows at a
 * time; tl_row_f256 at 8; tl_row_c: one case per encoding each), then a register-blocked
 * microkernel (tl_mk_*) multiplies every row of x with it; meanwhile the next tile's codes are
 * prefetched into L2.
 *
 * The tile's layout lets the microkernels sum without a 16-lane reduction per result: rows are
 * kept in groups of G (4 for AVX-512, 2 for AVX2, 1 in plain C), and a group's rows are
 * interleaved in 16-byte chunks (8 bfloat16 or 4 float32 of one row): chunk c of the group is
 * [row 0's chunk c, row 1's, ..., row G-1's], one vector. A step multiplies that vector with the
 * same 16 bytes of a row of x broadcast to every 128-bit lane, so each lane sums one weight row;
 * at the end four lanes per row are added (the group's vectors transposed by unpacks) and the
 * 16 (8) results of consecutive rows are stored at once, with the int8 row scales applied.
 *
 * Two numeric forms:
 *   bf16   (x bfloat16, weights allowed in bfloat16, a CPU with AVX512_BF16): each weight is
 *          formed in float32 exactly as the torch dequantizers form it (code * absmax, q * d,
 *          (d * scale) * q) and rounded to bfloat16 once (VCVTNE2PS2BF16, nearest-even, as
 *          torch's cast), so the tile equals the chunked path's dequantized rows bit for bit;
 *          VDPBF16PS multiplies pairs exactly and sums in float32. int8 per row keeps its codes
 *          exact (an int8 is a bfloat16) and scales the float32 sum once, more faithful still;
 *          int8 per block forms q * scale as the others do.
 *   float32 (every other case, and CPUs without AVX512_BF16): weights in float32, x widened to
 *          float32, FMA sums in float32.
 * Rows of x are zero-padded to Kp (a multiple of TL_KALIGN), tile rows likewise, so the
 * microkernels have no tails; a tile's unused last rows are computed and never stored.
 */

enum { TL_NF4 = 0, TL_INT8 = 1, TL_Q8_0 = 2, TL_Q6_K = 3 };  /* tiled_matmul's `kind` */
#define TL_ROWS 64         /* W rows per tile: 64 x 2048 bfloat16 are 256 KiB of L2 */
#define TL_KALIGN 32       /* K padded to a multiple of this: one bfloat16 vector */
#define TL_MR 6            /* x rows per microkernel call, AVX-512: 24 accumulators of 32 */
#define TL_MR_AVX2 2       /* AVX2: 8 accumulators of 16 */
#define TL_MR_C 4          /* plain C */
#define TL_NR_C 4          /* W rows per call in plain C (AVX-512: 16, AVX2: 8, four groups) */

typedef struct tl_job tl_job;
/* A microkernel: rows m0 .. m0 + mr - 1 of x (`x` at row m0) by the first `valid` of its 16, 8
 * or 4 tile rows (`w` at the first one's group), output rows n0 .., results stored in out. */
typedef void (*tl_mk_fn)(const tl_job *j, const void *x, const void *w, Py_ssize_t m0,
                         Py_ssize_t n0, int valid);

struct tl_job {
    int enc, bf16, isa, out_kind;
    const uint8_t *codes;       /* NF4 [N, K/2]; int8 [N, K]; Q8_0 / Q6_K blocks, row-major */
    const float *scales, *table; /* NF4 absmax [N, K/bs] and 16 levels; int8 [N, K/bs] (bs K:
                                  * one per row, applied to the sums; else to the weights) */
    Py_ssize_t blocksize, M, N, K, Kp, stride;
    Py_ssize_t *next_tile;      /* shared by the jobs: the next tile no thread has taken */
    const void *x;              /* [M, Kp]: bfloat16 bits when bf16, else float32 */
    void *out;
    void *tile;                 /* TL_ROWS x Kp, bfloat16 or float32, zero past K */
    float *row;                 /* Kp float32: a row formed in C before the tile's layout */
    int group, chunk;           /* the tile's layout: rows per group, elements per chunk */
};

/* Whether the job's scales multiply the sums (int8 per row) rather than the weights. */
static inline int tl_row_scaled(const tl_job *j)
{
    return j->enc == TL_INT8 && j->blocksize == j->K;
}

/* Row n of W in float32 (int8 per row: the codes, its scale applied to the sums). The reference for
 * every vector dequantizer, and their fallback for NF4 blocksizes they do not step by. */
static void tl_row_c(const tl_job *j, Py_ssize_t n, float *dst)
{
    const uint8_t *p = j->codes + n * j->stride;
    Py_ssize_t K = j->K;
    if (j->enc == TL_NF4) {
        Py_ssize_t bs = j->blocksize;
        const float *am = j->scales + n * (K / bs);
        for (Py_ssize_t i = 0; i < K; i += 2) {
            float a = am[i / bs];
            dst[i] = j->table[p[i / 2] >> 4] * a;
            dst[i + 1] = j->table[p[i / 2] & 15] * a;
        }
    } else if (j->enc == TL_INT8) {
        Py_ssize_t bs = j->blocksize;
        const float *am = j->scales + n * (K / bs);
        for (Py_ssize_t i = 0; i < K; i++)
            dst[i] = tl_row_scaled(j) ? (float)(int8_t)p[i] : (float)(int8_t)p[i] * am[i / bs];
    } else if (j->enc == TL_Q8_0) {
        for (Py_ssize_t b = 0; b < K / Q8_BLOCK; b++, p += Q8_BLOCK_BYTES) {
            float d = q8_scale(p);
            for (int i = 0; i < Q8_BLOCK; i++)
                dst[b * Q8_BLOCK + i] = (float)(int8_t)p[2 + i] * d;
        }
    } else {
        for (Py_ssize_t b = 0; b < K / Q6_BLOCK; b++)
            q6_block_c(p + b * Q6_BLOCK_BYTES, dst + b * Q6_BLOCK);
    }
}

/* Where element k of row r (of its group) lies from the group's start, in elements. */
static inline Py_ssize_t tl_at(const tl_job *j, int r, Py_ssize_t k)
{
    return k / j->chunk * j->group * j->chunk + r * j->chunk + k % j->chunk;
}

/* Row n of W formed by tl_row_c, into row r of the group at `grp` (rounded to bfloat16 when the
 * tile is). */
static void tl_row_c_into(const tl_job *j, Py_ssize_t n, void *grp, int r)
{
    tl_row_c(j, n, j->row);
    for (Py_ssize_t k = 0; k < j->K; k++) {
        if (j->bf16)
            ((uint16_t *)grp)[tl_at(j, r, k)] = to_bf16(j->row[k]);
        else
            ((float *)grp)[tl_at(j, r, k)] = j->row[k];
    }
}

/* One result: scaled (int8), rounded to the output's kind, stored. */
static inline void tl_store(const tl_job *j, Py_ssize_t m, Py_ssize_t n, float v)
{
    Py_ssize_t o = m * j->N + n;
    if (tl_row_scaled(j))
        v *= j->scales[n];
    if (j->out_kind == 0)
        ((float *)j->out)[o] = v;
    else
        ((uint16_t *)j->out)[o] = to_bf16(v);
}

/* Plain C microkernel: mr rows of x (float32) by TL_NR_C rows of a row-major tile. */
static inline void tl_mk_c(const tl_job *j, const void *xv, const void *wv, Py_ssize_t m0,
                           Py_ssize_t n0, int valid, int mr)
{
    const float *x = xv, *w = wv;
    Py_ssize_t Kp = j->Kp;
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < valid; n++) {
            float s = 0.0f;
            for (Py_ssize_t k = 0; k < Kp; k++)
                s += x[m * Kp + k] * w[n * Kp + k];
            tl_store(j, m0 + m, n0 + n, s);
        }
}

#define TL_MK_FN(PREFIX, KERNEL, TARGET, MR)                                                  \
    TARGET static void PREFIX##_##MR(const tl_job *j, const void *x, const void *w,           \
                                     Py_ssize_t m0, Py_ssize_t n0, int valid)                  \
    {                                                                                          \
        KERNEL(j, x, w, m0, n0, valid, MR);                                                    \
    }
TL_MK_FN(tl_mk_c, tl_mk_c, , 1)
TL_MK_FN(tl_mk_c, tl_mk_c, , 2)
TL_MK_FN(tl_mk_c, tl_mk_c, , 3)
TL_MK_FN(tl_mk_c, tl_mk_c, , 4)
static const tl_mk_fn tl_mks_c[TL_MR_C] = {tl_mk_c_1, tl_mk_c_2, tl_mk_c_3, tl_mk_c_4};

#ifdef LCT_X86
#define TL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define TL_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define TL_AVX2 __attribute__((target("avx2,fma")))

/* 16 signed bytes -> 16 float32 (exact). */
TL_AVX512 __attribute__((always_inline)) static inline __m512 tl_i8x16(__m128i v)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}

TL_AVX2 __attribute__((always_inline)) static inline __m256 tl_i8x8(__m128i v)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}

/* NF4: 16 code bytes -> their 32 table indices as 16-bit words in element order (element 2i is
 * byte i's high nibble, 2i + 1 its low nibble). */
TL_AVX512 __attribute__((always_inline)) static inline __m512i tl_nf4_idx512(const uint8_t *p)
{
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_or_si512(_mm512_srli_epi32(v, 4),
                           _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(15)), 16));
}

/* Four rows' 64 bytes from the same element (v[r]: row r's four 16-byte chunks) into their
 * group, where the four chunks are four consecutive vectors (a 4 x 4 transpose of 128-bit
 * lanes) at `dst`. */
TL_AVX512 __attribute__((always_inline)) static inline void tl_put4(char *dst, const __m512i *v)
{
    __m512i t0 = _mm512_shuffle_i64x2(v[0], v[1], 0x44);
    __m512i t1 = _mm512_shuffle_i64x2(v[0], v[1], 0xEE);
    __m512i t2 = _mm512_shuffle_i64x2(v[2], v[3], 0x44);
    __m512i t3 = _mm512_shuffle_i64x2(v[2], v[3], 0xEE);
    _mm512_storeu_si512(dst, _mm512_shuffle_i64x2(t0, t2, 0x88));
    _mm512_storeu_si512(dst + 64, _mm512_shuffle_i64x2(t0, t2, 0xDD));
    _mm512_storeu_si512(dst + 128, _mm512_shuffle_i64x2(t1, t3, 0x88));
    _mm512_storeu_si512(dst + 192, _mm512_shuffle_i64x2(t1, t3, 0xDD));
}

/* Rows n .. n + 3 of W into a group of 4 at 16 lanes, as bfloat16 (bf16: tl_row_c's float32
 * values, each rounded once; chunks of 8) or float32 (chunks of 4); `count` of them real, the
 * others a copy of row n (computed, never stored). Four rows at once so that each vector of
 * the group is written whole. NF4 needs blocksize % 32 == 0 (the caller checks). Compiled with
 * AVX512_BF16 enabled for its bf16 form; the float32 form executes no BF16 instruction (its
 * bf16 branches are constant false). */
TL_BF16 __attribute__((always_inline)) static inline void
tl_group512(const tl_job *j, Py_ssize_t n, int count, void *grpv, const int bf16)
{
    char *grp = grpv;
    const uint8_t *p[4];
    for (int r = 0; r < 4; r++)
        p[r] = j->codes + (n + (r < count ? r : 0)) * j->stride;
    Py_ssize_t K = j->K, i = 0;
    const int step = bf16 ? 32 : 16;   /* elements of a row per vector */
    const Py_ssize_t bytes = bf16 ? 8 : 16;   /* group bytes per element of a row */
    __m512i v[4];
/* the vector of row r's 32 (bf16) or 16 values a (16), b (16) */
#define TL_V(r, a, b) \
    (v[r] = bf16 ? (__m512i)_mm512_cvtne2ps_pbh((b), (a)) : _mm512_castps_si512(a))
    if (j->enc == TL_NF4) {
        Py_ssize_t bs = j->blocksize;
        const __m512 code = _mm512_loadu_ps(j->table);
        for (Py_ssize_t b = 0; b < K / bs; b++) {
            __m512 lv[4];   /* each row's 16 levels for this block, code * absmax */
            __m512i lb[4];  /* the same rounded to bfloat16, for VPERMW */
            for (int r = 0; r < 4; r++) {
                lv[r] = _mm512_mul_ps(code, _mm512_set1_ps(j->scales[(p[r] - j->codes) / j->stride
                                                                     * (K / bs) + b]));
                if (bf16)
                    lb[r] = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(lv[r]));
            }
            for (i = b * bs; i < (b + 1) * bs; i += 32) {
                for (int r = 0; r < 4; r++) {
                    if (!(i & 127))
                        _mm_prefetch((const char *)p[r] + i / 2 + MM_PREFETCH, _MM_HINT_T0);
                    __m512i idx = tl_nf4_idx512(p[r] + i / 2);
                    if (bf16) {
                        v[r] = _mm512_permutexvar_epi16(idx, lb[r]);
                    } else {
                        __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(idx));
                        v[r] = _mm512_castps_si512(_mm512_permutexvar_ps(lo, lv[r]));
                    }
                }
                tl_put4(grp + i * bytes, v);
                if (!bf16) {
                    for (int r = 0; r < 4; r++) {
                        __m512i idx = tl_nf4_idx512(p[r] + i / 2);
                        __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(idx, 1));
                        v[r] = _mm512_castps_si512(_mm512_permutexvar_ps(hi, lv[r]));
                    }
                    tl_put4(grp + (i + 16) * bytes, v);
                }
            }
        }
    } else if (j->enc == TL_INT8 && !tl_row_scaled(j)) {
        /* per block (blocksize a multiple of 32): each code times its block's scale */
        Py_ssize_t bs = j->blocksize, nb = K / bs;
        for (Py_ssize_t b = 0; b < nb; b++) {
            __m512 d[4];
            for (int r = 0; r < 4; r++)
                d[r] = _mm512_set1_ps(j->scales[(p[r] - j->codes) / j->stride * nb + b]);
            for (i = b * bs; i < (b + 1) * bs; i += step) {
                for (int r = 0; r < 4; r++) {
                    if (!(i & 63))
                        _mm_prefetch((const char *)p[r] + i + MM_PREFETCH, _MM_HINT_T0);
                    __m512 a = _mm512_mul_ps(tl_i8x16(_mm_loadu_si128((const __m128i *)(p[r] + i))),
                                             d[r]);
                    TL_V(r, a, bf16 ? _mm512_mul_ps(tl_i8x16(_mm_loadu_si128(
                                                       (const __m128i *)(p[r] + i + 16))), d[r])
                                    : a);
                }
                tl_put4(grp + i * bytes, v);
            }
        }
    } else if (j->enc == TL_INT8) {
        for (; i + step <= K; i += step) {
            for (int r = 0; r < 4; r++) {
                if (!(i & 63))
                    _mm_prefetch((const char *)p[r] + i + MM_PREFETCH, _MM_HINT_T0);
                __m512 a = tl_i8x16(_mm_loadu_si128((const __m128i *)(p[r] + i)));
                TL_V(r, a, bf16 ? tl_i8x16(_mm_loadu_si128((const __m128i *)(p[r] + i + 16))) : a);
            }
            tl_put4(grp + i * bytes, v);
        }
        for (int r = 0; r < count; r++)
            for (Py_ssize_t k = i; k < K; k++) {
                float f = (float)(int8_t)p[r][k];
                if (bf16)
                    ((uint16_t *)grp)[tl_at(j, r, k)] = to_bf16(f);
                else
                    ((float *)grp)[tl_at(j, r, k)] = f;
            }
    } else if (j->enc == TL_Q8_0) {
        for (Py_ssize_t b = 0; i < K; i += Q8_BLOCK, b += Q8_BLOCK_BYTES) {
            __m512 d[4], a[4], c[4];
            for (int r = 0; r < 4; r++) {
                const uint8_t *q = p[r] + b;
                _mm_prefetch((const char *)q + MM_PREFETCH, _MM_HINT_T0);
                d[r] = _mm512_set1_ps(q8_scale(q));
                a[r] = _mm512_mul_ps(tl_i8x16(_mm_loadu_si128((const __m128i *)(q + 2))), d[r]);
                c[r] = _mm512_mul_ps(tl_i8x16(_mm_loadu_si128((const __m128i *)(q + 18))), d[r]);
                TL_V(r, a[r], c[r]);
            }
            tl_put4(grp + i * bytes, v);
            if (!bf16) {
                for (int r = 0; r < 4; r++)
                    v[r] = _mm512_castps_si512(c[r]);
                tl_put4(grp + (i + 16) * bytes, v);
            }
        }
    } else {
        for (Py_ssize_t b = 0; i < K; i += Q6_BLOCK, b += Q6_BLOCK_BYTES) {
            __m512 ds[4];   /* each row's 16 sub-block scales d * scale, in float32 */
            for (int r = 0; r < 4; r++) {
                for (int c = 0; c < Q6_BLOCK_BYTES; c += 64)
                    _mm_prefetch((const char *)p[r] + b + c + MM_PREFETCH, _MM_HINT_T0);
                ds[r] = _mm512_mul_ps(tl_i8x16(_mm_loadu_si128((const __m128i *)(p[r] + b + 192))),
                                      _mm512_set1_ps(q6_d(p[r] + b)));
            }
            for (int h = 0; h < 2; h++) {
                __m256i q[4][4];
                for (int r = 0; r < 4; r++)
                    q6_codes(p[r] + b, h, q[r]);
                for (int g = 0; g < 4; g++) {
                    const __m512i s0 = _mm512_set1_epi32(8 * h + 2 * g);
                    const __m512i s1 = _mm512_set1_epi32(8 * h + 2 * g + 1);
                    __m512 c[4];
                    for (int r = 0; r < 4; r++) {
                        __m512 a = _mm512_mul_ps(tl_i8x16(_mm256_castsi256_si128(q[r][g])),
                                                 _mm512_permutexvar_ps(s0, ds[r]));
                        c[r] = _mm512_mul_ps(tl_i8x16(_mm256_extracti128_si256(q[r][g], 1)),
                                             _mm512_permutexvar_ps(s1, ds[r]));
                        TL_V(r, a, c[r]);
                    }
                    Py_ssize_t k = i + 128 * h + 32 * g;
                    tl_put4(grp + k * bytes, v);
                    if (!bf16) {
                        for (int r = 0; r < 4; r++)
                            v[r] = _mm512_castps_si512(c[r]);
                        tl_put4(grp + (k + 16) * bytes, v);
                    }
                }
            }
        }
    }
#undef TL_V
}

TL_BF16 static void tl_group_bf16(const tl_job *j, Py_ssize_t n, int count, void *grp)
{
    tl_group512(j, n, count, grp, 1);
}

TL_BF16 static void tl_group_f512(const tl_job *j, Py_ssize_t n, int count, void *grp)
{
    tl_group512(j, n, count, grp, 0);
}

/* 8 float32 of row r from element k into a group of 2 (chunks of 4): two chunks, 32 bytes
 * apart. */
TL_AVX2 __attribute__((always_inline)) static inline void tl_put256(char *grp, Py_ssize_t at,
                                                                     __m256 v)
{
    _mm_storeu_ps((float *)(grp + at), _mm256_castps256_ps128(v));
    _mm_storeu_ps((float *)(grp + at + 32), _mm256_extractf128_ps(v, 1));
}

/* Row n of W in float32 into row r of a group of 2 (chunks of 4). NF4 needs blocksize % 16
 * == 0. */
TL_AVX2 static void tl_row_f256(const tl_job *j, Py_ssize_t n, void *grpv, int r)
{
    char *grp = grpv;
    const uint8_t *p = j->codes + n * j->stride;
    Py_ssize_t K = j->K, i = 0;
#define TL_AT8(k) (((k) / 4 * 8 + r * 4) * 4)   /* byte offset of row r's element k */
    if (j->enc == TL_NF4) {
        Py_ssize_t bs = j->blocksize;
        const float *am = j->scales + n * (K / bs);
        const __m256 clo = _mm256_loadu_ps(j->table), chi = _mm256_loadu_ps(j->table + 8);
        const __m256i low = _mm256_set1_epi32(15);
        for (Py_ssize_t b = 0; b < K / bs; b++) {
            __m256 a = _mm256_set1_ps(am[b]);
            __m256 tlo = _mm256_mul_ps(clo, a), thi = _mm256_mul_ps(chi, a);
            for (i = b * bs; i < (b + 1) * bs; i += 16) {
                if (!(i & 127))
                    _mm_prefetch((const char *)p + i / 2 + MM_PREFETCH, _MM_HINT_T0);
                __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + i / 2)));
                __m256i idx = _mm256_or_si256(_mm256_srli_epi32(v, 4),
                                              _mm256_slli_epi32(_mm256_and_si256(v, low), 16));
                __m256i lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(idx));
                __m256i hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(idx, 1));
                tl_put256(grp, TL_AT8(i), lookup16(tlo, thi, lo));
                tl_put256(grp, TL_AT8(i + 8), lookup16(tlo, thi, hi));
            }
        }
    } else if (j->enc == TL_INT8 && !tl_row_scaled(j)) {
        Py_ssize_t bs = j->blocksize;
        const float *am = j->scales + n * (K / bs);
        for (; i < K; i += 8) {     /* blocksize a multiple of 32 */
            if (!(i & 63))
                _mm_prefetch((const char *)p + i + MM_PREFETCH, _MM_HINT_T0);
            tl_put256(grp, TL_AT8(i), _mm256_mul_ps(tl_i8x8(_mm_loadl_epi64((const __m128i *)(p + i))),
                                                    _mm256_set1_ps(am[i / bs])));
        }
    } else if (j->enc == TL_INT8) {
        for (; i + 8 <= K; i += 8) {
            if (!(i & 63))
                _mm_prefetch((const char *)p + i + MM_PREFETCH, _MM_HINT_T0);
            tl_put256(grp, TL_AT8(i), tl_i8x8(_mm_loadl_epi64((const __m128i *)(p + i))));
        }
        for (; i < K; i++)
            ((float *)grp)[tl_at(j, r, i)] = (float)(int8_t)p[i];
    } else if (j->enc == TL_Q8_0) {
        for (; i < K; i += Q8_BLOCK, p += Q8_BLOCK_BYTES) {
            _mm_prefetch((const char *)p + MM_PREFETCH, _MM_HINT_T0);
            __m256 d = _mm256_set1_ps(q8_scale(p));
            for (int h = 0; h < Q8_BLOCK; h += 8)
                tl_put256(grp, TL_AT8(i + h), _mm256_mul_ps(
                    tl_i8x8(_mm_loadl_epi64((const __m128i *)(p + 2 + h))), d));
        }
    } else {
        for (; i < K; i += Q6_BLOCK, p += Q6_BLOCK_BYTES) {
            for (int c = 0; c < Q6_BLOCK_BYTES; c += 64)
                _mm_prefetch((const char *)p + c + MM_PREFETCH, _MM_HINT_T0);
            float ds[16];
            q6_scales(p, ds);
            for (int h = 0; h < 2; h++) {
                __m256i q[4];
                q6_codes(p, h, q);
                for (int g = 0; g < 4; g++) {
                    Py_ssize_t k = i + 128 * h + 32 * g;
                    __m128i lo = _mm256_castsi256_si128(q[g]);
                    __m128i hi = _mm256_extracti128_si256(q[g], 1);
                    __m256 da = _mm256_broadcast_ss(ds + 8 * h + 2 * g);
                    __m256 db = _mm256_broadcast_ss(ds + 8 * h + 2 * g + 1);
                    tl_put256(grp, TL_AT8(k), _mm256_mul_ps(tl_i8x8(lo), da));
                    tl_put256(grp, TL_AT8(k + 8),
                              _mm256_mul_ps(tl_i8x8(_mm_unpackhi_epi64(lo, lo)), da));
                    tl_put256(grp, TL_AT8(k + 16), _mm256_mul_ps(tl_i8x8(hi), db));
                    tl_put256(grp, TL_AT8(k + 24),
                              _mm256_mul_ps(tl_i8x8(_mm_unpackhi_epi64(hi, hi)), db));
                }
            }
        }
    }
#undef TL_AT8
}

/* Four accumulators of one row of x, each 4 lanes x 4 partial sums (lane r: row 4 v + r of
 * accumulator v), -> the 16 rows' sums in row order, scaled (int8) and stored (masked to
 * `valid`) as float32 or bfloat16. */
TL_AVX512 __attribute__((always_inline)) static inline void
tl_out512(const tl_job *j, const __m512 *a, Py_ssize_t m, Py_ssize_t n0, __mmask16 mask)
{
    __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    __m512d d0 = _mm512_castps_pd(t0), d1 = _mm512_castps_pd(t1);
    __m512 u = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));
    /* u[4 r + v] is row 4 v + r */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512 s = _mm512_permutexvar_ps(order, u);
    if (tl_row_scaled(j))
        s = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(mask, j->scales + n0));
    Py_ssize_t o = m * j->N + n0;
    if (j->out_kind == 0) {
        _mm512_mask_storeu_ps((float *)j->out + o, mask, s);
    } else {
        /* to_bf16's rounding: nearest-even, NaN to the canonical quiet NaN */
        __m512i b = _mm512_castps_si512(s);
        b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                  _mm512_and_si512(_mm512_srli_epi32(b, 16),
                                                                   _mm512_set1_epi32(1))));
        b = _mm512_mask_mov_epi32(_mm512_srli_epi32(b, 16), _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q),
                                  _mm512_set1_epi32(0x7FC0));
        _mm256_mask_storeu_epi16((uint16_t *)j->out + o, mask, _mm512_cvtepi32_epi16(b));
    }
}

/* The bfloat16 microkernel: mr rows of x by 16 tile rows (4 groups of 4), 8 products a lane
 * pair a step. */
TL_BF16 __attribute__((always_inline)) static inline void
tl_mk_bf16(const tl_job *j, const void *xv, const void *wv, Py_ssize_t m0, Py_ssize_t n0,
           int valid, int mr)
{
    const uint16_t *x = xv, *w = wv;
    Py_ssize_t Kp = j->Kp;
    __m512 acc[TL_MR * 4];
    for (int i = 0; i < mr * 4; i++)
        acc[i] = _mm512_setzero_ps();
    for (Py_ssize_t k = 0; k < Kp; k += 8) {
        __m512bh b[4];
        for (int v = 0; v < 4; v++)
            b[v] = (__m512bh)_mm512_loadu_si512(w + v * 4 * Kp + 4 * k);
        for (int m = 0; m < mr; m++) {
            __m512bh a = (__m512bh)_mm512_broadcast_i32x4(
                _mm_loadu_si128((const __m128i *)(x + m * Kp + k)));
            for (int v = 0; v < 4; v++)
                acc[4 * m + v] = _mm512_dpbf16_ps(acc[4 * m + v], a, b[v]);
        }
    }
    __mmask16 mask = valid >= 16 ? 0xFFFF : (__mmask16)((1u << valid) - 1);
    for (int m = 0; m < mr; m++)
        tl_out512(j, acc + 4 * m, m0 + m, n0, mask);
}

/* The float32 microkernel at 16 lanes: mr rows of x by 16 tile rows, 4 products a lane a step. */
TL_AVX512 __attribute__((always_inline)) static inline void
tl_mk_f512(const tl_job *j, const void *xv, const void *wv, Py_ssize_t m0, Py_ssize_t n0,
           int valid, int mr)
{
    const float *x = xv, *w = wv;
    Py_ssize_t Kp = j->Kp;
    __m512 acc[TL_MR * 4];
    for (int i = 0; i < mr * 4; i++)
        acc[i] = _mm512_setzero_ps();
    for (Py_ssize_t k = 0; k < Kp; k += 4) {
        __m512 b[4];
        for (int v = 0; v < 4; v++)
            b[v] = _mm512_loadu_ps(w + v * 4 * Kp + 4 * k);
        for (int m = 0; m < mr; m++) {
            __m512 a = _mm512_broadcast_f32x4(_mm_loadu_ps(x + m * Kp + k));
            for (int v = 0; v < 4; v++)
                acc[4 * m + v] = _mm512_fmadd_ps(a, b[v], acc[4 * m + v]);
        }
    }
    __mmask16 mask = valid >= 16 ? 0xFFFF : (__mmask16)((1u << valid) - 1);
    for (int m = 0; m < mr; m++)
        tl_out512(j, acc + 4 * m, m0 + m, n0, mask);
}

/* tl_out512 at 8 lanes: four accumulators, each 2 lanes x 4 partial sums (lane h: row 2 v + h
 * of accumulator v), -> the 8 rows' sums in row order, scaled (int8) and stored (the first
 * `valid`). */
TL_AVX2 __attribute__((always_inline)) static inline void
tl_out256(const tl_job *j, const __m256 *a, Py_ssize_t m, Py_ssize_t n0, int valid)
{
    __m256 t0 = _mm256_add_ps(_mm256_unpacklo_ps(a[0], a[1]), _mm256_unpackhi_ps(a[0], a[1]));
    __m256 t1 = _mm256_add_ps(_mm256_unpacklo_ps(a[2], a[3]), _mm256_unpackhi_ps(a[2], a[3]));
    __m256d d0 = _mm256_castps_pd(t0), d1 = _mm256_castps_pd(t1);
    __m256 u = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(d0, d1)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(d0, d1)));
    /* u[4 h + v] is row 2 v + h */
    __m256 r = _mm256_permutevar8x32_ps(u, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    if (tl_row_scaled(j))
        r = _mm256_mul_ps(r, _mm256_maskload_ps(j->scales + n0, mask));
    Py_ssize_t o = m * j->N + n0;
    if (j->out_kind == 0) {
        _mm256_maskstore_ps((float *)j->out + o, mask, r);
        return;
    }
    __m256i b = _mm256_castps_si256(r);   /* to_bf16's rounding, NaN canonical */
    b = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF),
                                              _mm256_and_si256(_mm256_srli_epi32(b, 16),
                                                               _mm256_set1_epi32(1))));
    b = _mm256_blendv_epi8(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x7FC0),
                           _mm256_castps_si256(_mm256_cmp_ps(r, r, _CMP_UNORD_Q)));
    uint16_t h[16];
    _mm256_storeu_si256((__m256i *)h, _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08));
    for (int i = 0; i < valid; i++)
        ((uint16_t *)j->out)[o + i] = h[i];
}

/* The float32 microkernel at 8 lanes: mr (1, 2) rows of x by 8 tile rows (4 groups of 2).
 * Named accumulators: GCC keeps an array of them in memory here, storing it every step. */
TL_AVX2 __attribute__((always_inline)) static inline void
tl_mk_f256(const tl_job *j, const void *xv, const void *wv, Py_ssize_t m0, Py_ssize_t n0,
           int valid, int mr)
{
    const float *x = xv, *w = wv;
    Py_ssize_t Kp = j->Kp;
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, d0 = c0, d1 = c0, d2 = c0,
           d3 = c0;
    for (Py_ssize_t k = 0; k < Kp; k += 4) {
        __m256 a = _mm256_broadcast_ps((const __m128 *)(x + k));
        __m256 e = mr > 1 ? _mm256_broadcast_ps((const __m128 *)(x + Kp + k)) : a;
        __m256 b0 = _mm256_loadu_ps(w + 2 * k), b1 = _mm256_loadu_ps(w + 2 * Kp + 2 * k);
        __m256 b2 = _mm256_loadu_ps(w + 4 * Kp + 2 * k), b3 = _mm256_loadu_ps(w + 6 * Kp + 2 * k);
        c0 = _mm256_fmadd_ps(a, b0, c0);
        c1 = _mm256_fmadd_ps(a, b1, c1);
        c2 = _mm256_fmadd_ps(a, b2, c2);
        c3 = _mm256_fmadd_ps(a, b3, c3);
        if (mr > 1) {
            d0 = _mm256_fmadd_ps(e, b0, d0);
            d1 = _mm256_fmadd_ps(e, b1, d1);
            d2 = _mm256_fmadd_ps(e, b2, d2);
            d3 = _mm256_fmadd_ps(e, b3, d3);
        }
    }
    __m256 first[4] = {c0, c1, c2, c3};
    tl_out256(j, first, m0, n0, valid);
    if (mr > 1) {
        __m256 second[4] = {d0, d1, d2, d3};
        tl_out256(j, second, m0 + 1, n0, valid);
    }
}

TL_MK_FN(tl_mk_bf16, tl_mk_bf16, TL_BF16, 1)
TL_MK_FN(tl_mk_bf16, tl_mk_bf16, TL_BF16, 2)
TL_MK_FN(tl_mk_bf16, tl_mk_bf16, TL_BF16, 3)
TL_MK_FN(tl_mk_bf16, tl_mk_bf16, TL_BF16, 4)
TL_MK_FN(tl_mk_bf16, tl_mk_bf16, TL_BF16, 5)
TL_MK_FN(tl_mk_bf16, tl_mk_bf16, TL_BF16, 6)
TL_MK_FN(tl_mk_f512, tl_mk_f512, TL_AVX512, 1)
TL_MK_FN(tl_mk_f512, tl_mk_f512, TL_AVX512, 2)
TL_MK_FN(tl_mk_f512, tl_mk_f512, TL_AVX512, 3)
TL_MK_FN(tl_mk_f512, tl_mk_f512, TL_AVX512, 4)
TL_MK_FN(tl_mk_f512, tl_mk_f512, TL_AVX512, 5)
TL_MK_FN(tl_mk_f512, tl_mk_f512, TL_AVX512, 6)
TL_MK_FN(tl_mk_f256, tl_mk_f256, TL_AVX2, 1)
TL_MK_FN(tl_mk_f256, tl_mk_f256, TL_AVX2, 2)
static const tl_mk_fn tl_mks_bf16[TL_MR] = {tl_mk_bf16_1, tl_mk_bf16_2, tl_mk_bf16_3,
                                            tl_mk_bf16_4, tl_mk_bf16_5, tl_mk_bf16_6};
static const tl_mk_fn tl_mks_f512[TL_MR] = {tl_mk_f512_1, tl_mk_f512_2, tl_mk_f512_3,
                                            tl_mk_f512_4, tl_mk_f512_5, tl_mk_f512_6};
static const tl_mk_fn tl_mks_f256[TL_MR_AVX2] = {tl_mk_f256_1, tl_mk_f256_2};
#endif

/* The instruction set the tiles use at `isa`: AVX-512 tiles also need BW, VL and DQ (every
 * AVX-512 CPU but Xeon Phi has them), else AVX2's. Call with the GIL held (it caches). */
static int tl_isa(int isa)
{
#ifdef LCT_X86
    static int bw = -1;
    if (bw < 0)
        bw = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")
             && __builtin_cpu_supports("avx512dq");
    if (isa == ISA_AVX512 && !bw)
        return ISA_AVX2;
#endif
    return isa;
}

/* The job's form: the tile layout (rows per group, elements per chunk), the microkernels and
 * their rows of x and of W per call. */
static void tl_setup(tl_job *j, const tl_mk_fn **mks, int *mr, int *nr)
{
    j->group = j->chunk = 1;
    *mks = tl_mks_c;
    *mr = TL_MR_C;
    *nr = TL_NR_C;
#ifdef LCT_X86
    if (j->bf16 || j->isa >= ISA_AVX512) {
        j->group = 4;
        j->chunk = j->bf16 ? 8 : 4;
        *mks = j->bf16 ? tl_mks_bf16 : tl_mks_f512;
        *mr = TL_MR;
        *nr = 16;
    } else if (j->isa >= ISA_AVX2) {
        j->group = 2;
        j->chunk = 4;
        *mks = tl_mks_f256;
        *mr = TL_MR_AVX2;
        *nr = 8;
    }
#endif
}

/* Rows n .. n + count - 1 of W (count <= the group's rows) into tile rows tr .. (tr at a group's
 * start), by the widest dequantizer that steps through its encoding (NF4 blocks of fewer than
 * 32 (AVX2: 16) weights fall back to C). */
static void tl_rows(const tl_job *j, Py_ssize_t n, Py_ssize_t tr, int count)
{
    size_t esz = j->bf16 ? 2 : 4;
    char *grp = (char *)j->tile + tr * j->Kp * esz;
#ifdef LCT_X86
    int nf4_step = j->enc != TL_NF4 ? 1 : j->group == 4 ? j->blocksize % 32 == 0
                                                        : j->blocksize % 16 == 0;
    if (nf4_step && j->group == 4) {
        (j->bf16 ? tl_group_bf16 : tl_group_f512)(j, n, count, grp);
        return;
    }
    if (nf4_step && j->group == 2) {
        for (int r = 0; r < count; r++)
            tl_row_f256(j, n + r, grp, r);
        return;
    }
#endif
    for (int r = 0; r < count; r++)
        tl_row_c_into(j, n + r, grp, r);
}

static void *tl_worker(void *arg)
{
    tl_job *j = arg;
    const tl_mk_fn *mks;
    int mrmax, nr;
    tl_setup(j, &mks, &mrmax, &nr);
    size_t esz = j->bf16 ? 2 : 4;
    Py_ssize_t Kp = j->Kp, blocks = (j->M + mrmax - 1) / mrmax;
    Py_ssize_t tiles = (j->N + TL_ROWS - 1) / TL_ROWS;
    const char *x = j->x, *tile = j->tile;
    Py_ssize_t cur = __atomic_fetch_add(j->next_tile, 1, __ATOMIC_RELAXED);
    while (cur < tiles) {
        Py_ssize_t nxt = __atomic_fetch_add(j->next_tile, 1, __ATOMIC_RELAXED);
        Py_ssize_t n = cur * TL_ROWS, rows = j->N - n < TL_ROWS ? j->N - n : TL_ROWS;
        for (Py_ssize_t r = 0; r < rows; r += j->group)
            tl_rows(j, n + r, r, rows - r < j->group ? (int)(rows - r) : j->group);
        /* the next tile's codes reach L2 while this one is multiplied: a slice of them per
         * microkernel call, spread so as not to flood the miss queue. Not NF4's, whose rows'
         * own prefetch suffices (measured, 256k x 2048 head: int8, Q8_0, Q6_K 5-10 % faster
         * with it at M = 8..64, NF4 2-8 % slower) */
        Py_ssize_t ahead = 0;
        if (nxt < tiles && j->enc != TL_NF4) {
            Py_ssize_t left = j->N - nxt * TL_ROWS;
            ahead = (left < TL_ROWS ? left : TL_ROWS) * j->stride;
        }
        const char *next = (const char *)j->codes + nxt * TL_ROWS * j->stride;
        Py_ssize_t calls = blocks * ((rows + nr - 1) / nr);
        Py_ssize_t slice = (ahead / calls + 64) & ~(Py_ssize_t)63, done = 0;
        for (Py_ssize_t mb = 0; mb < blocks; mb++) {
            Py_ssize_t m = mb * mrmax;
            int mr = j->M - m < mrmax ? (int)(j->M - m) : mrmax;
            for (Py_ssize_t nb = 0; nb < rows; nb += nr) {
                for (Py_ssize_t end = done + slice; done < end && done < ahead; done += 64)
                    __builtin_prefetch(next + done, 0, 2);
                int valid = rows - nb < nr ? (int)(rows - nb) : nr;
                mks[mr - 1](j, x + m * Kp * esz, tile + nb * Kp * esz, m, n + nb, valid);
            }
        }
        cur = nxt;
    }
    return NULL;
}
