/* Matrix products on block-quantised weights, read in the GGUF file's own values.

   y[m, n] = sum_k x[m, k] * w[n, k], where every block of 32 weights along k is stored as
     Q4_1: w = d * q + min, q in 0..15, two per byte (byte j of a block: q[j] low, q[j+16] high)
     Q8_0: w = d * q,       q in -127..127, one per byte
   with d and min per block in float32 (they come from the file's float16, so d * q is exact and
   d * q + min rounds once, exactly as the float32 copy of the weights did).

   Why: a one-token decode step reads every weight once and is bound by those reads. float32
   weights are 4 bytes; these are 0.5 + 8/32 (Q4_1) and 1 + 4/32 (Q8_0).

   Each output is summed in one fixed order (two 16-lane or four 8-lane partial sums over k, then
   one reduction), whatever the number of rows m and whichever thread computes it: a row gives
   the same bits alone as among others, so verifying drafts, batching sequences and one-token
   decoding compute identical matrix products.

   Two arithmetics: float32 x times the blocks (the target's products: exactly its float32
   weights, summed in float32), and x rounded to int8 with integer dot products (the drafters':
   "int8 activations" below). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "kernels.h"

/* ---- AVX-512: 8 rows of x at a time, 2 partial sums of 16 lanes per row ---- */

#define TILE512 8

__attribute__((target("avx512f,avx512bw")))
static inline __m512 q4_half512(const uint8_t *bytes, int high, __m512 d, __m512 mn) {
    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    q = high ? _mm512_srli_epi32(q, 4) : _mm512_and_si512(q, _mm512_set1_epi32(15));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, mn);
}

__attribute__((target("avx512f,avx512bw")))
static inline __m512 q8_half512(const int8_t *q, __m512 d) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))), d);
}

__attribute__((target("avx512f,avx512bw")))
static void linear512(const float *x, int64_t rows, int64_t k, const uint8_t *q4, const int8_t *q8,
                      const float *scale, const float *minimum, int64_t n_out, float *y) {
    const int64_t blocks = k / BLOCK;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        for (int64_t r0 = 0; r0 < rows; r0 += TILE512) {
            const int tile = rows - r0 < TILE512 ? (int)(rows - r0) : TILE512;
            __m512 lo[TILE512], hi[TILE512];
            for (int r = 0; r < tile; r++) lo[r] = hi[r] = _mm512_setzero_ps();
            for (int64_t b = 0; b < blocks; b++) {
                const __m512 d = _mm512_set1_ps(scale[n * blocks + b]);
                __m512 w_lo, w_hi;
                if (q4) {
                    const __m512 mn = _mm512_set1_ps(minimum[n * blocks + b]);
                    const uint8_t *bytes = q4 + (n * blocks + b) * (BLOCK / 2);
                    w_lo = q4_half512(bytes, 0, d, mn);
                    w_hi = q4_half512(bytes, 1, d, mn);
                } else {
                    const int8_t *q = q8 + (n * blocks + b) * BLOCK;
                    w_lo = q8_half512(q, d);
                    w_hi = q8_half512(q + 16, d);
                }
                const float *xb = x + r0 * k + b * BLOCK;
                for (int r = 0; r < tile; r++) {
                    lo[r] = _mm512_fmadd_ps(w_lo, _mm512_loadu_ps(xb + r * k), lo[r]);
                    hi[r] = _mm512_fmadd_ps(w_hi, _mm512_loadu_ps(xb + r * k + 16), hi[r]);
                }
            }
            for (int r = 0; r < tile; r++)
                y[(r0 + r) * n_out + n] = _mm512_reduce_add_ps(_mm512_add_ps(lo[r], hi[r]));
        }
    }
}

/* ---- AVX2: 4 rows of x at a time, 4 partial sums of 8 lanes per row ---- */

#define TILE256 4

__attribute__((target("avx2,fma")))
static inline float sum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma")))
static void linear256(const float *x, int64_t rows, int64_t k, const uint8_t *q4, const int8_t *q8,
                      const float *scale, const float *minimum, int64_t n_out, float *y) {
    const int64_t blocks = k / BLOCK;
    #pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        for (int64_t r0 = 0; r0 < rows; r0 += TILE256) {
            const int tile = rows - r0 < TILE256 ? (int)(rows - r0) : TILE256;
            __m256 acc[TILE256][4];
            for (int r = 0; r < tile; r++)
                for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
            for (int64_t b = 0; b < blocks; b++) {
                const __m256 d = _mm256_set1_ps(scale[n * blocks + b]);
                __m256 w[4];
                if (q4) {
                    const __m256 mn = _mm256_set1_ps(minimum[n * blocks + b]);
                    const uint8_t *bytes = q4 + (n * blocks + b) * (BLOCK / 2);
                    for (int j = 0; j < 2; j++) {
                        __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + 8 * j)));
                        w[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(15))), d, mn);
                        w[j + 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), d, mn);
                    }
                } else {
                    const int8_t *q = q8 + (n * blocks + b) * BLOCK;
                    for (int j = 0; j < 4; j++)
                        w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * j)))), d);
                }
                const float *xb = x + r0 * k + b * BLOCK;
                for (int r = 0; r < tile; r++)
                    for (int j = 0; j < 4; j++)
                        acc[r][j] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xb + r * k + 8 * j), acc[r][j]);
            }
            for (int r = 0; r < tile; r++)
                y[(r0 + r) * n_out + n] = sum256(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]),
                                                               _mm256_add_ps(acc[r][2], acc[r][3])));
        }
    }
}

/* ---- int8 activations (AVX-512 VNNI), llama.cpp's arithmetic, for the drafters ----

   Each row of x is rounded per block of 32 as Q8_0 rounds weights (x ~ dx * qx, qx in -127..127,
   dx = max|x| / 127), so a block's product is an integer dot product, exact in int32:
     Q4_1: sum w x ~ d dx sum(q qx) + min dx sum(qx)
     Q8_0: sum w x ~ d dx sum((q + 128) qx) - 128 d dx sum(qx), the Q4_1 form with min = -128 d,
           because the instruction multiplies unsigned bytes (weights) by signed bytes (x).
   The rounding of x depends on the row alone, so a row still has the same bits alone as among
   others. It is an approximation the target cannot take: a row's products are the same bits
   wherever it is, but the attention before them sums in an order that depends on the number of
   rows, and a last-bit difference that moves x across a rounding boundary moves its int8 value a
   whole step; the drafters can, since their numbers only decide what they propose.

   Why another layout: VPDPBUSD sums 4 byte products into each of 16 int32 lanes. With the
   weights of 16 outputs interleaved 4 bytes per lane (int8_layout in blockquant.py), one
   instruction advances 16 outputs by 4 inputs for a row, the 4 bytes of x broadcast to every
   lane: no horizontal sums, and a block's weights, unpacked once, serve every row of the tile.
   Per group of 16 outputs and block of 32 inputs the layout holds
     Q4_1: 4 chunks of 64 bytes, chunk c, lane i, byte j = q[i][8c + j] | q[i][8c + 4 + j] << 4
     Q8_0: 8 chunks of 64 bytes, chunk c, lane i, byte j = q[i][4c + j] + 128
   and the 16 outputs' d (and min) as 16 floats. */

/* Each block of 32: d = max|x| / 127, q = x * (1 / d) rounded to the nearest integer (ties to even), in 16-lane
   registers; every operation is exact or rounds once per value, so it gives what a scalar loop would. */
__attribute__((target("avx512f,avx512bw")))
static void quantize_rows(const float *x, int64_t rows, int64_t k, int8_t *qx, float *dx, float *sx) {
    const int64_t blocks = k / BLOCK;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *xb = x + r * k + b * BLOCK;
            const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            const float d = amax / 127.0f, inverse = d > 0.0f ? 1.0f / d : 0.0f;
            const __m512 scale = _mm512_set1_ps(inverse);
            const int rounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            const __m512i q_lo = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(lo, scale), rounding));
            const __m512i q_hi = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(hi, scale), rounding));
            _mm_storeu_si128((__m128i *)(qx + r * k + b * BLOCK), _mm512_cvtsepi32_epi8(q_lo));
            _mm_storeu_si128((__m128i *)(qx + r * k + b * BLOCK + 16), _mm512_cvtsepi32_epi8(q_hi));
            dx[r * blocks + b] = d;
            sx[r * blocks + b] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q_lo, q_hi));
        }
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static inline __m512i four_inputs(const int8_t *q) {  /* q[0..3] in every int32 lane */
    int32_t word;
    memcpy(&word, q, sizeof word);
    return _mm512_set1_epi32(word);
}

/* How far ahead a tile asks for weights: 24 blocks (6 KB of Q4_1 bytes, 12 KB of Q8_0); 16 to 64 measured alike
   for several rows into L2, 12 and 48 no better non-temporally. Into L1 (_MM_HINT_T0), one row was slower. */
#define PREFETCH_BLOCKS 24

/* One tile of the product: the 16 outputs of group g by `tile` rows from r0 (1 to TILE512). `tile` is a constant
   where it is inlined (linear512_int8), so that every accumulator stays in a register and no instruction tests
   how many rows there are: that made a one-row step of the target 0.8x the time of a loop over a tile's rows
   counted at run time, and 4 to 12 rows 0.8-0.85x.
   A tile also asks for the weights PREFETCH_BLOCKS blocks ahead of the one it multiplies: with only the
   hardware's prefetcher, each block's arithmetic left memory idle until the next block's loads missed, so every
   row a verify added cost its products' whole time on top of the reads, and even one row read the weights
   slower than memory gives them. It asks non-temporally (_MM_HINT_NTA): a weight is read once a step, and the
   target's 111 MB pass through caches a third that size: a forward of 1 to 12 rows takes 0.83-0.96x the time it
   took asking into L2 (_MM_HINT_T1; docs/benchmarks.md, "What a step costs"). Prefetching changes no
   arithmetic: the same bits. */
__attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline))
static inline void int8_tile(const int tile, const int8_t *qx, const float *dx, const float *sx, int64_t r0, int64_t k,
                             const uint8_t *q4, const uint8_t *q8, const float *scale, const float *minimum, int64_t g,
                             int64_t n_out, float *y) {
    const int64_t blocks = k / BLOCK;
    __m512 acc[TILE512];
    for (int r = 0; r < tile; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t at = g * blocks + b;
        const int64_t ahead = at + PREFETCH_BLOCKS;
        if (ahead < n_out / GROUP * blocks) {  /* that block's bytes (4 or 8 lines), its d and min (a line each) */
            const char *bytes = q4 ? (const char *)(q4 + ahead * 4 * 64) : (const char *)(q8 + ahead * 8 * 64);
            for (int c = 0; c < (q4 ? 4 : 8); c++) _mm_prefetch(bytes + c * 64, _MM_HINT_NTA);
            _mm_prefetch((const char *)(scale + ahead * GROUP), _MM_HINT_NTA);
            if (q4) _mm_prefetch((const char *)(minimum + ahead * GROUP), _MM_HINT_NTA);
        }
        __m512i dot[TILE512];
        for (int r = 0; r < tile; r++) dot[r] = _mm512_setzero_si512();
        if (q4) {
            for (int64_t c = 0; c < 4; c++) {  /* low nibbles: inputs 8c..8c+3, high nibbles: 8c+4..8c+7 */
                const __m512i bytes = _mm512_loadu_si512(q4 + (at * 4 + c) * 64);
                const __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi8(15));
                const __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), _mm512_set1_epi8(15));
                for (int r = 0; r < tile; r++) {
                    const int8_t *xr = qx + (r0 + r) * k + b * BLOCK + 8 * c;
                    dot[r] = _mm512_dpbusd_epi32(dot[r], low, four_inputs(xr));
                    dot[r] = _mm512_dpbusd_epi32(dot[r], high, four_inputs(xr + 4));
                }
            }
        } else {
            for (int64_t c = 0; c < 8; c++) {
                const __m512i bytes = _mm512_loadu_si512(q8 + (at * 8 + c) * 64);
                for (int r = 0; r < tile; r++)
                    dot[r] = _mm512_dpbusd_epi32(dot[r], bytes, four_inputs(qx + (r0 + r) * k + b * BLOCK + 4 * c));
            }
        }
        const __m512 d = _mm512_loadu_ps(scale + at * GROUP);
        const __m512 mn = q4 ? _mm512_loadu_ps(minimum + at * GROUP) : _mm512_mul_ps(d, _mm512_set1_ps(-128.0f));
        for (int r = 0; r < tile; r++) {  /* this block's share, in one fixed order for every row */
            const int64_t row = r0 + r;
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(d, _mm512_set1_ps(dx[row * blocks + b])), acc[r]);
            acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx[row * blocks + b]), acc[r]);
        }
    }
    for (int r = 0; r < tile; r++) _mm512_storeu_ps(y + (r0 + r) * n_out + g * GROUP, acc[r]);
}

#define INT8_TILE(tile) int8_tile(tile, qx, dx, sx, r0, k, q4, q8, scale, minimum, g, n_out, y)

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void linear512_int8(const int8_t *qx, const float *dx, const float *sx, int64_t rows, int64_t k,
                           const uint8_t *q4, const uint8_t *q8, const float *scale, const float *minimum,
                           int64_t n_out, float *y) {
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < n_out / GROUP; g++) {
        for (int64_t r0 = 0; r0 < rows; r0 += TILE512) {
            switch (rows - r0 < TILE512 ? rows - r0 : TILE512) {
                case 1: INT8_TILE(1); break;
                case 2: INT8_TILE(2); break;
                case 3: INT8_TILE(3); break;
                case 4: INT8_TILE(4); break;
                case 5: INT8_TILE(5); break;
                case 6: INT8_TILE(6); break;
                case 7: INT8_TILE(7); break;
                default: INT8_TILE(8);
            }
        }
    }
}

void int8_product(const float *x, int64_t rows, int64_t k, const uint8_t *q4, const uint8_t *q8, const float *scale,
                  const float *minimum, int64_t n_out, float *y, int8_t *qx, float *dx, float *sx) {
    quantize_rows(x, rows, k, qx, dx, sx);
    linear512_int8(qx, dx, sx, rows, k, q4, q8, scale, minimum, n_out, y);
}

/* ---- entry points (ctypes) ---- */

/* The widest instruction set this CPU runs: 3 = AVX-512 with VNNI, 2 = AVX-512, 1 = AVX2 with FMA, 0 = neither. */
int blockquant_best_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"))
        return __builtin_cpu_supports("avx512vnni") ? 3 : 2;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
    return 0;
}

/* y[rows, n_out] = x[rows, k] @ w[n_out, k]^T; exactly one of q4 (with minimum) and q8 is given.
   Float32 x: the blocks as in the GGUF file (q8 signed). int8_activations: x rounded to int8
   blocks, the weights in the int8 layout above (q8 offset to unsigned), AVX-512 VNNI only. */
int blockquant_linear(int isa, int int8_activations, const float *x, int64_t rows, int64_t k, const uint8_t *q4,
                      const int8_t *q8, const float *scale, const float *minimum, int64_t n_out, float *y) {
    if (k % BLOCK != 0 || (q4 == 0) == (q8 == 0) || (q4 && minimum == 0)) return -1;
    if (int8_activations) {
        if (isa < 3 || n_out % GROUP != 0) return -1;
        const int64_t blocks = k / BLOCK;
        int8_t *qx = malloc(rows * k);
        float *dx = malloc(rows * blocks * sizeof(float)), *sx = malloc(rows * blocks * sizeof(float));
        const int status = qx && dx && sx ? 0 : -2;
        if (status == 0) int8_product(x, rows, k, q4, (const uint8_t *)q8, scale, minimum, n_out, y, qx, dx, sx);
        free(qx); free(dx); free(sx);
        return status;
    }
    if (isa >= 2) linear512(x, rows, k, q4, q8, scale, minimum, n_out, y);
    else if (isa == 1) linear256(x, rows, k, q4, q8, scale, minimum, n_out, y);
    else return -1;
    return 0;
}

/* ---- each row's largest value (greedy verification) ---- */

#define ARGMAX_WAYS 4  /* independent running maxima, so that each compare waits on one made 4 loads before */

/* The index of x[0..n)'s largest value, the first of equal ones (torch.argmax's rule); NaN never wins. */
__attribute__((target("avx512f")))
static int64_t argmax_row(const float *x, int64_t n) {
    __m512 best[ARGMAX_WAYS];
    __m512i at[ARGMAX_WAYS];
    for (int w = 0; w < ARGMAX_WAYS; w++) {
        best[w] = _mm512_set1_ps(-INFINITY);
        at[w] = _mm512_setzero_si512();
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int64_t i = 0;
    for (; i + ARGMAX_WAYS * LANES <= n; i += ARGMAX_WAYS * LANES)
        for (int w = 0; w < ARGMAX_WAYS; w++) {
            const __m512 v = _mm512_loadu_ps(x + i + w * LANES);
            const __mmask16 greater = _mm512_cmp_ps_mask(v, best[w], _CMP_GT_OQ);  /* strictly: a lane keeps its first */
            best[w] = _mm512_mask_mov_ps(best[w], greater, v);
            at[w] = _mm512_mask_mov_epi32(at[w], greater, _mm512_add_epi32(lane, _mm512_set1_epi32((int32_t)(i + w * LANES))));
        }
    /* The lanes' candidates: the largest value, the smallest index among equals. A lane that never moved holds
       -inf at index 0, which is right where every value is -inf. The tail's indices come after all of theirs. */
    float value = -INFINITY;
    int64_t index = 0;
    for (int w = 0; w < ARGMAX_WAYS; w++) {
        float values[LANES];
        int32_t indices[LANES];
        _mm512_storeu_ps(values, best[w]);
        _mm512_storeu_si512(indices, at[w]);
        for (int l = 0; l < LANES; l++)
            if (values[l] > value || (values[l] == value && indices[l] < index)) {
                value = values[l];
                index = indices[l];
            }
    }
    for (; i < n; i++)
        if (x[i] > value) {
            value = x[i];
            index = i;
        }
    return index;
}

/* out[r] = argmax_row of row r of x [rows, n]. Why: torch's argmax took 60-90 us a row of the target's 49,152
   logits, a verify pays it for every row, and this reads a row at the speed of the cache. 0 on success, -1 where
   the CPU lacks AVX-512 or a row is too long for 32-bit lane indices (the caller uses torch's). */
int blockquant_argmax(const float *x, int64_t rows, int64_t n, int64_t *out) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || n > INT32_MAX) return -1;
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * n, n);
    return 0;
}

/* ---- each row's most likely tokens (a drafter's guesses) ---- */

/* The k largest values of x[0..n) and their indices, largest first, the first of equal values first, into values
   and indices, then each as a log-probability of the row's softmax: x - max - log(sum(exp(x - max))). One pass
   keeps the k best (a register's lanes are looked at one by one only where one beats the k-th), a second sums the
   exponentials. NaN never enters. -> how many it holds: k, unless the row has fewer numbers than k. */
__attribute__((target("avx512f")))
static int64_t top_log_probs_row(const float *x, int64_t n, int64_t k, float *values, int64_t *indices) {
    int64_t held = 0;
    float worst = -INFINITY;  /* the k-th best once k are held: a value must beat it to enter */
    __m512 most = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += LANES) {
        const __mmask16 inside = (__mmask16)((1u << (n - i < LANES ? n - i : LANES)) - 1);
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), inside, x + i);
        most = _mm512_max_ps(most, v);
        __mmask16 lanes = held < k ? inside : _mm512_mask_cmp_ps_mask(inside, v, _mm512_set1_ps(worst), _CMP_GT_OQ);
        for (; lanes; lanes &= lanes - 1) {
            const int64_t at = i + __builtin_ctz(lanes);
            const float value = x[at];
            if (held < k ? value != value : !(value > worst)) continue;  /* NaN; or the k-th rose in this register */
            int64_t slot = held < k ? held++ : k - 1;  /* appended, or in the k-th's place; then after all >= it */
            for (; slot > 0 && value > values[slot - 1]; slot--) {
                values[slot] = values[slot - 1];
                indices[slot] = indices[slot - 1];
            }
            values[slot] = value;
            indices[slot] = at;
            if (held == k) worst = values[k - 1];
        }
    }
    const float largest = _mm512_reduce_max_ps(most);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += LANES) {
        const __mmask16 inside = (__mmask16)((1u << (n - i < LANES ? n - i : LANES)) - 1);
        const __m512 shifted = _mm512_sub_ps(_mm512_maskz_loadu_ps(inside, x + i), _mm512_set1_ps(largest));
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(inside, exp512(shifted)));
    }
    const float log_sum = largest + logf(_mm512_reduce_add_ps(sum));
    for (int64_t j = 0; j < held; j++) values[j] -= log_sum;
    return held;
}

/* values, indices [rows, k] = top_log_probs_row of each row of x [rows, n]. Why: torch's log_softmax and topk over
   a drafter's 8,192-token vocabulary took 100-170 us a step, most of it on caches that the step's products had
   just evicted. 0 on success; -1 where the CPU lacks AVX-512, k is not in
   1..n or a row has fewer than k numbers (the caller uses torch's). */
int blockquant_top_log_probs(const float *x, int64_t rows, int64_t n, int64_t k, float *values, int64_t *indices) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || k < 1 || k > n) return -1;
    for (int64_t r = 0; r < rows; r++)
        if (top_log_probs_row(x + r * n, n, k, values + r * k, indices + r * k) < k) return -1;
    return 0;
}

/* ---- a sample of each row's softmax (the target's choice at T > 0) ---- */

/* A token and its weight. Most likely first, then the lower index: a total order, so the nucleus is one set of
   tokens whatever the selection's path to it. */
typedef struct {
    float w;
    int32_t i;
} weighted;

static inline int ahead(weighted a, weighted b) { return a.w > b.w || (a.w == b.w && a.i < b.i); }

static int by_likelihood(const void *a, const void *b) {
    const weighted x = *(const weighted *)a, y = *(const weighted *)b;
    return x.i == y.i ? 0 : ahead(x, y) ? -1 : 1;
}

static int by_index(const void *a, const void *b) {
    const weighted x = *(const weighted *)a, y = *(const weighted *)b;
    return (x.i > y.i) - (x.i < y.i);
}

/* An estimate of the mass of the weights w[0..n) (n a multiple of 16) at or above `bound`: float32 sums. */
__attribute__((target("avx512f")))
static float mass_from(const float *w, int64_t n, float bound) {
    const __m512 least = _mm512_set1_ps(bound);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += LANES) {
        const __m512 v = _mm512_loadu_ps(w + i);
        sum = _mm512_mask_add_ps(sum, _mm512_cmp_ps_mask(v, least, _CMP_GE_OQ), sum, v);
    }
    return _mm512_reduce_add_ps(sum);
}

/* top_p's nucleus of the weights w[0..n) (n a multiple of 16, total their sum, the largest about 1): most likely
   first, every token whose mass before it is below top_p * total (the most likely always) -> how many, their tokens
   in t[0..count) in index order (t: room for n). Looked for among the tokens at or above a bound, the largest power of
   2 at or above which the weights' estimated mass reaches top_p * total, halved until one of them is outside: then
   so is every less likely token. Why: a selection or a sort of all 49,152 took longer than the rest of the sample. */
__attribute__((target("avx512f")))
static int64_t nucleus(const float *w, int64_t n, double total, double top_p, weighted *t) {
    const double reach = top_p * total;
    float bound = 1.0f;
    while (bound > 0.0f && (double)mass_from(w, n, bound) < reach) bound *= 0.5f;
    for (;;) {
        const __m512 least = _mm512_set1_ps(bound);
        int64_t count = 0, kept;
        for (int64_t i = 0; i < n; i += LANES) {
            const __m512 v = _mm512_loadu_ps(w + i);
            const __mmask16 above = _mm512_cmp_ps_mask(v, least, _CMP_GE_OQ);
            for (__mmask16 m = above & _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GT_OQ); m; m &= m - 1) {
                const int64_t j = i + __builtin_ctz(m);
                t[count++] = (weighted){w[j], (int32_t)j};
            }
        }
        qsort(t, count, sizeof *t, by_likelihood);
        double before = 0.0;  /* the mass of the tokens more likely than token `kept` */
        for (kept = 0; kept < count && before < reach; kept++) before += (double)t[kept].w;
        if (kept < count || bound == 0.0f) {
            qsort(t, kept, sizeof *t, by_index);
            return kept;
        }
        bound *= 0.5f;  /* every token at or above the bound is in: look below it too */
    }
}

/* A token of x[0..n) drawn with the uniform number u in [0, 1) from softmax(x / T), inverse_t = 1 / T, by inverting
   its cumulative distribution: weights w_i = exp((x_i - max) / T) (float32, 0 for x_i = -inf; into the scratch w
   [n rounded up to 16]), summed per 16 in one fixed order and those sums added up in float64, first to last; token
   i is chosen iff u * total falls in its interval of the cumulative sums, so each token is drawn with probability
   w_i / total. Within the 16 holding u * total the scan adds in float64 again: a last-bit shortfall against the
   16's sum (about 1e-7 of it) goes to the last token of weight above 0 there. With top_p < 1, only top_p's nucleus
   (nucleus(), t its scratch) is drawn from, in index order, its weights summed in float64 one by one (a shortfall
   to its last token). -> the token, or -1 for a row with NaN or +inf, or every value -inf. */
__attribute__((target("avx512f")))
static int64_t sample_row(const float *x, int64_t n, float inverse_t, double top_p, double u, float *w, double *sums,
                          weighted *t) {
    __m512 most = _mm512_set1_ps(-INFINITY);
    __mmask16 broken = 0;
    for (int64_t i = 0; i < n; i += LANES) {
        const __mmask16 inside = (__mmask16)((1u << (n - i < LANES ? n - i : LANES)) - 1);
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), inside, x + i);
        broken |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
        most = _mm512_max_ps(most, v);
    }
    const float top = _mm512_reduce_max_ps(most);
    if (broken || top == -INFINITY) return -1;
    const __m512 largest = _mm512_set1_ps(top), scale = _mm512_set1_ps(inverse_t);
    const int64_t groups = (n + LANES - 1) / LANES;
    double total = 0.0;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t i = g * LANES;
        const __mmask16 inside = (__mmask16)((1u << (n - i < LANES ? n - i : LANES)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(inside, x + i);
        const __mmask16 counted = _mm512_mask_cmp_ps_mask(inside, v, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        const __m512 weights = _mm512_maskz_mov_ps(counted, exp512(_mm512_mul_ps(_mm512_sub_ps(v, largest), scale)));
        _mm512_storeu_ps(w + i, weights);
        total += (double)_mm512_reduce_add_ps(weights);
        sums[g] = total;  /* the cumulative sum up to the end of group g */
    }
    if (top_p < 1.0) {
        const int64_t count = nucleus(w, groups * LANES, total, top_p, t);
        double mass = 0.0;
        for (int64_t j = 0; j < count; j++) mass += (double)t[j].w;
        const double threshold = u * mass;
        double cumulative = 0.0;
        for (int64_t j = 0; j < count; j++) {
            cumulative += (double)t[j].w;
            if (cumulative > threshold) return t[j].i;
        }
        return t[count - 1].i;
    }
    const double threshold = u * total;
    int64_t g = 0;
    while (g < groups - 1 && !(sums[g] > threshold)) g++;
    double cumulative = g > 0 ? sums[g - 1] : 0.0;
    int64_t last = -1;  /* the group's last token of weight above 0 */
    for (int64_t i = g * LANES; i < n && i < (g + 1) * LANES; i++) {
        if (!(w[i] > 0.0f)) continue;
        last = i;
        cumulative += (double)w[i];
        if (cumulative > threshold) return i;
    }
    return last;
}

/* out[r] = sample_row of row r of x [rows, n] with uniforms[r], top_p in (0, 1] (1: every token). Why: torch's
   float64 softmax, cumulative sum and search took 270 us for one row of the target's 49,152 logits and 540 us for a
   verify of 6, and a nucleus 0.4 ms more a row. 0 on success;
   -1 where the CPU lacks AVX-512, inverse_t is not above 0, top_p is outside (0, 1], n does not fit an int32, a row
   has NaN or +inf or nothing but -inf, or memory runs out (the caller uses torch's). */
int blockquant_sample(const float *x, int64_t rows, int64_t n, float inverse_t, double top_p, const double *uniforms,
                      int64_t *out) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || !(inverse_t > 0.0f) || !(top_p > 0.0 && top_p <= 1.0) || n < 1
        || n > INT32_MAX)
        return -1;
    const int64_t groups = (n + LANES - 1) / LANES;
    int failed = 0;
    /* the rows of a verify on every thread: each row's draw is its own, whichever thread takes it */
    #pragma omp parallel if (rows > 1) reduction(|:failed)
    {
        float *w = malloc(groups * LANES * sizeof(float));
        double *sums = malloc(groups * sizeof(double));
        weighted *t = top_p < 1.0 ? malloc(n * sizeof(weighted)) : NULL;
        const int ready = w && sums && (t || top_p == 1.0);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) {
            if (!ready) {  /* still take part in the loop: every thread must reach it */
                failed = 1;
                continue;
            }
            out[r] = sample_row(x + r * n, n, inverse_t, top_p, uniforms[r], w, sums, t);
            if (out[r] < 0) failed = 1;
        }
        free(w);
        free(sums);
        free(t);
    }
    return failed ? -1 : 0;
}
