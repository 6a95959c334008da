/* Row-exact attention for the target: every query row computed alone, in one fixed order.

   Why: verification must compute each row's logits exactly as the one-token step at its place
   would, or a near tie can commit another token than plain decoding. The matrix products are
   row-invariant (blockquant.c); a library's attention over T query rows is not (it blocks the
   rows and keys by T, so a row's sums run in another order than alone). A last-bit difference is
   harmless on float32 activations, but rounding activations to int8 turns it into a whole step.
   Here each (row, head) pair runs the same code over the same keys in the same order as a
   one-token step: its bits do not depend on the other rows.

   It also does what comes before attention on the new tokens' rows, RoPE on queries and keys and the
   keys' and values' writes into the cache, in one call instead of a dozen small torch operations. The cache
   holds them as float16 (rounded to nearest when stored, widened exactly when read; the arithmetic is
   float32): a step of many sequences, or over a long prefix, is bound by reading it. A new row's own key is
   stored before any row reads it, so it reads the same rounded key a one-token step later reads from the cache.

   The keys a row sees: the `cached` slots 0..cached-1 of its layer's cache (those cached_visible[row]
   allows, where it is given: an EAGLE-3 draft tree's other branches sit in its drafter's cache),
   then the new tokens j (slots cached + j) that visible[row][j] allows, ascending: for a chain, the
   row's predecessors and itself; for a draft tree, its ancestors and itself, whose keys equal those
   the one-token steps along that branch stored at consecutive slots. A key's place in that list,
   not its slot, decides every summation order below.

   Per (row, head): scores s_n = q . k_n / sqrt(D), each a dot product of 16-lane partial sums
   reduced in one fixed order (a halving tree, as GCC's _mm512_reduce_add_ps sums; eight keys' trees run
   side by side in the same registers, sum_tree8); p_n = exp(s_n - max s); out = sum_n p_n v_n / sum_n p_n,
   summed in list order (16 lanes over n for the denominator, lanes over D for the numerator). The query
   heads that share a key head run side by side (attend_heads), each with exactly its own arithmetic,
   so the cache is read once per key head, not once per query head. AVX-512 only: the target's int8
   products, which need it, run on AVX-512 VNNI. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "kernels.h"

static inline __mmask16 live_lanes(int64_t left) {  /* the first min(left, 16) lanes */
    return left >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

/* 16 cached float16 values as float32 (exact: every float16 is a float32) */
__attribute__((target("avx512f")))
static inline __m512 load_half(const uint16_t *x) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)x));
}

/* The sum of a vector's 16 lanes as a halving tree: lane i + lane i + 8, then i + 4, i + 2, i + 1 (GCC's
   _mm512_reduce_add_ps, written out so that sum_tree8 is its exact twin whichever compiler builds this). */
__attribute__((target("avx512f")))
static inline float sum_tree(__m512 a) {
    const __m256 eight = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)), _mm512_castps512_ps256(a));
    const __m128 four = _mm_add_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(two) + _mm_cvtss_f32(_mm_shuffle_ps(two, two, 1));
}

/* sum_tree of a[0..7], each sum its own tree's bits, for eight vectors at once: every level adds the same
   lane pairs as sum_tree, for two, four, then eight vectors in one register. Key j's scores at lane j. */
__attribute__((target("avx512f")))
static inline __m256 sum_tree8(const __m512 a[8]) {
    __m512 halves[4], quarters[2];
    for (int j = 0; j < 4; j++)  /* lanes i + 8 and i of a[2j] (lanes 0-7) and of a[2j + 1] (lanes 8-15) */
        halves[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                                  _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)));
    for (int j = 0; j < 2; j++)  /* i + 4 and i within each 8: 128-bit lane m holds vector 4j + m's four */
        quarters[j] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * j], halves[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                                    _mm512_shuffle_f32x4(halves[2 * j], halves[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)));
    /* i and i + 2: 128-bit lane m holds vector m's two, then vector m + 4's two */
    const __m512 pairs = _mm512_add_ps(_mm512_shuffle_ps(quarters[0], quarters[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_ps(quarters[0], quarters[1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* 0 and 1: vector m's sum at lane 4m, vector m + 4's at 4m + 2 */
    const __m512 sums = _mm512_add_ps(pairs, _mm512_permute_ps(pairs, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, sums));
}

__attribute__((target("avx512f")))
static inline float dot512(const float *a, const uint16_t *b, int64_t d) {
    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), load_half(b));
    for (int64_t i = LANES; i < d; i += LANES)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load_half(b + i), acc);
    return sum_tree(acc);
}

/* Up to QUERIES query heads at a time read each key and value row of their (shared) key head once: a step of a
   few rows is bound by reading the cache more than by arithmetic. */
#define QUERIES 4
/* Query heads scored together over eight keys: their 8 * SCORED accumulators, SCORED query vectors and a key
   fit the 32 vector registers. */
#define SCORED 3

/* The scores of `count` query heads q (1 to SCORED: a constant where inlined) for the eight keys listed in slots,
   into p[h * stride]: each key's 16-lane chunk widened from float16 straight into a register and multiplied
   into every head's accumulator for that key, so no key is written to memory and read back per head. Each score
   is dot512's arithmetic (the first chunk's product, then one fused multiply-add per chunk in order) summed by
   sum_tree8: the bits of each head and key alone. */
__attribute__((target("avx512f"), always_inline))
static inline void score8(const int count, const float *const *q, const uint16_t *k, const int32_t *slots, int64_t d,
                          float scale, float *p, int64_t stride) {
    __m512 acc[SCORED][8], query[SCORED];
    for (int h = 0; h < count; h++) query[h] = _mm512_loadu_ps(q[h]);
    for (int j = 0; j < 8; j++) {
        const __m512 key = load_half(k + slots[j] * d);
        for (int h = 0; h < count; h++) acc[h][j] = _mm512_mul_ps(query[h], key);
    }
    for (int64_t i = LANES; i < d; i += LANES) {
        for (int h = 0; h < count; h++) query[h] = _mm512_loadu_ps(q[h] + i);
        for (int j = 0; j < 8; j++) {
            const __m512 key = load_half(k + slots[j] * d + i);
            for (int h = 0; h < count; h++) acc[h][j] = _mm512_fmadd_ps(query[h], key, acc[h][j]);
        }
    }
    for (int h = 0; h < count; h++) _mm256_storeu_ps(p + h * stride, _mm256_mul_ps(sum_tree8(acc[h]), _mm256_set1_ps(scale)));
}

/* out[h][i .. i + 16 * width) = the weights p[h * stride + n] times the value rows of slots[n], summed key by key
   in list order, for `count` heads (1 to QUERIES) and `width` chunks of 16 (1 to 4), both constants where inlined
   (a count or width tested inside the key loop cost a compare and a branch per head and chunk): each value row's
   chunks widened once for every head, one broadcast weight per head. */
__attribute__((target("avx512f"), always_inline))
static inline void weigh_values(const int count, const int width, const float *p, int64_t stride, const uint16_t *v,
                                const int32_t *slots, int64_t n_keys, int64_t d, int64_t i, const float *inverse,
                                float *const *out) {
    __m512 acc[QUERIES][4];
    for (int h = 0; h < count; h++)
        for (int c = 0; c < width; c++) acc[h][c] = _mm512_setzero_ps();
    for (int64_t n = 0; n < n_keys; n++) {
        const uint16_t *row = v + slots[n] * d + i;
        __m512 values[4];
        for (int c = 0; c < width; c++) values[c] = load_half(row + c * LANES);
        for (int h = 0; h < count; h++) {
            const __m512 weight = _mm512_set1_ps(p[h * stride + n]);
            for (int c = 0; c < width; c++) acc[h][c] = _mm512_fmadd_ps(weight, values[c], acc[h][c]);
        }
    }
    for (int h = 0; h < count; h++)
        for (int c = 0; c < width; c++)
            _mm512_storeu_ps(out[h] + i + c * LANES, _mm512_mul_ps(acc[h][c], _mm512_set1_ps(inverse[h])));
}

/* One row's query heads q[count] (count <= QUERIES, of one key head) over the keys listed in `slots` [n_keys] of
   k/v [capacity, D] -> out[count] [D]. p holds count * stride floats, stride >= n_keys rounded up to 16. Each
   head's arithmetic is what it would be alone. */
__attribute__((target("avx512f")))
static void attend_heads(const float *const *q, int64_t count, const uint16_t *k, const uint16_t *v, const int32_t *slots,
                         int64_t n_keys, int64_t d, float scale, float *p, int64_t stride, float *const *out) {
    /* Scores eight keys at a time, SCORED heads at a time; the last few keys one by one (dot512). */
    int64_t n = 0;
    for (; n + 8 <= n_keys; n += 8)
        for (int64_t h = 0; h < count; h += SCORED)
            switch (count - h < SCORED ? count - h : SCORED) {
                case 1: score8(1, q + h, k, slots + n, d, scale, p + h * stride + n, stride); break;
                case 2: score8(2, q + h, k, slots + n, d, scale, p + h * stride + n, stride); break;
                default: score8(3, q + h, k, slots + n, d, scale, p + h * stride + n, stride);
            }
    for (; n < n_keys; n++)
        for (int64_t h = 0; h < count; h++) p[h * stride + n] = dot512(q[h], k + slots[n] * d, d) * scale;
    float inverse[QUERIES];
    for (int64_t h = 0; h < count; h++) {
        float *ph = p + h * stride;
        __m512 most = _mm512_set1_ps(-INFINITY);
        for (int64_t n = 0; n < n_keys; n += LANES)
            most = _mm512_max_ps(most, _mm512_mask_loadu_ps(most, live_lanes(n_keys - n), ph + n));
        const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(most));
        __m512 total = _mm512_setzero_ps();
        for (int64_t n = 0; n < n_keys; n += LANES) {
            const __mmask16 live = live_lanes(n_keys - n);
            const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, ph + n), shift)));
            _mm512_mask_storeu_ps(ph + n, live, e);
            total = _mm512_add_ps(total, e);
        }
        inverse[h] = 1.0f / _mm512_reduce_add_ps(total);
    }
    /* The weighted values, 64 of the D values at a time (four independent sums per head), then the last 16-48. */
    int64_t i = 0;
    for (; i + 4 * LANES <= d; i += 4 * LANES)
        switch (count) {
            case 1: weigh_values(1, 4, p, stride, v, slots, n_keys, d, i, inverse, out); break;
            case 2: weigh_values(2, 4, p, stride, v, slots, n_keys, d, i, inverse, out); break;
            case 3: weigh_values(3, 4, p, stride, v, slots, n_keys, d, i, inverse, out); break;
            default: weigh_values(4, 4, p, stride, v, slots, n_keys, d, i, inverse, out);
        }
    if (i < d)
        for (int64_t h = 0; h < count; h++)  /* one head at a time: a rare shape (D not a multiple of 64) */
            switch ((d - i) / LANES) {
                case 1: weigh_values(1, 1, p + h * stride, stride, v, slots, n_keys, d, i, inverse + h, out + h); break;
                case 2: weigh_values(1, 2, p + h * stride, stride, v, slots, n_keys, d, i, inverse + h, out + h); break;
                default: weigh_values(1, 3, p + h * stride, stride, v, slots, n_keys, d, i, inverse + h, out + h);
            }
}

/* The keys (RoPE applied: row r at position positions[r] of the tables cos/sin [positions, D]) and values of `rows`
   new tokens into a layer's cache k/v [kv_heads, capacity, D] at slots cached..cached+rows-1, rounded to float16
   (to nearest); head g of row r at k_new[r * k_row + g * k_head] (v_new likewise). */
__attribute__((target("avx512f")))
void store_keys_values(const float *k_new, int64_t k_row, int64_t k_head, const float *v_new, int64_t v_row,
                       int64_t v_head, const float *cos, const float *sin, const int64_t *positions, uint16_t *k,
                       uint16_t *v, int64_t capacity, int64_t kv_heads, int64_t d, int64_t cached, int64_t rows) {
    float rotated[d];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < kv_heads; g++) {
            const int64_t slot = (g * capacity + cached + r) * d;
            rope(k_new + r * k_row + g * k_head, cos + positions[r] * d, sin + positions[r] * d, d, rotated);
            for (int64_t i = 0; i < d; i += LANES) {
                _mm256_storeu_si256((__m256i *)(k + slot + i), _mm512_cvtps_ph(_mm512_loadu_ps(rotated + i), ROUND_HALF));
                _mm256_storeu_si256((__m256i *)(v + slot + i),
                                    _mm512_cvtps_ph(_mm512_loadu_ps(v_new + r * v_row + g * v_head + i), ROUND_HALF));
            }
        }
}

/* One layer's attention for the new rows of n_segments sequences, laid end to end (a segment's rows follow the
   previous segment's), each sequence after its own `cached` positions in its own cache:
   - each row's key (RoPE applied) and value go into its segment's cache for `layer` at slots
     cached..cached+rows-1;
   - out[rows, heads * D] = each row's query (RoPE applied) attending to the keys its segment's visible and
     cached_visible let it see, as above.
   q, k_new, v_new: head h of row r at q[r * q_row + h * q_head] (views of the fused q/k/v product);
   cos/sin [positions, D]: the RoPE tables, row r at position positions[r]. Query head h reads key head
   h / (heads / kv_heads).
   Every (row, key head) of the whole batch is one item of a single parallel loop: a step of many sequences with
   a row each keeps both threads busy (one sequence has as few items as key heads) and pays one fork and join per
   layer, not one per sequence. An item's arithmetic does not depend on which thread runs it, nor on the others.
   0 on success, -1 for shapes it does not take, -2 when memory runs out. */
int attention_segments(const float *q, int64_t q_row, int64_t q_head, const float *k_new, int64_t k_row,
                       int64_t k_head, const float *v_new, int64_t v_row, int64_t v_head, const float *cos,
                       const float *sin, const int64_t *positions, const segment *segments, int64_t n_segments,
                       int64_t layer, int64_t heads, int64_t kv_heads, int64_t d, float *out) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512f") || d % LANES != 0 || heads % kv_heads != 0) return -1;
    int64_t rows = 0, most_keys = 0;
    for (int64_t s = 0; s < n_segments; s++) {
        const segment *seg = segments + s;
        if (seg->cached + seg->rows > seg->capacity) return -1;
        if (seg->cached + seg->rows > most_keys) most_keys = seg->cached + seg->rows;
        rows += seg->rows;
    }
    int64_t *segment_of = malloc((rows + 1) * sizeof(int64_t)), *first_of = malloc((n_segments + 1) * sizeof(int64_t));
    if (!segment_of || !first_of) {
        free(segment_of); free(first_of);
        return -2;
    }
    for (int64_t s = 0, first = 0; s < n_segments; first += segments[s++].rows) {
        const segment *seg = segments + s;
        const int64_t layer_cache = layer * kv_heads * seg->capacity * d;
        first_of[s] = first;
        for (int64_t r = first; r < first + seg->rows; r++) segment_of[r] = s;
        store_keys_values(k_new + first * k_row, k_row, k_head, v_new + first * v_row, v_row, v_head, cos, sin,
                          positions + first, seg->k + layer_cache, seg->v + layer_cache, seg->capacity, kv_heads, d,
                          seg->cached, seg->rows);
    }
    const float scale = 1.0f / sqrtf((float)d);
    const int64_t group = heads / kv_heads, stride = ((most_keys + LANES - 1) / LANES) * LANES;
    const int64_t batches = (group + QUERIES - 1) / QUERIES;  /* of a key head's query heads */
    int failed = 0;
    #pragma omp parallel reduction(|:failed)
    {
        int32_t *slots = malloc(most_keys * sizeof(int32_t));
        float *p = malloc((QUERIES * stride + QUERIES * d) * sizeof(float));
        /* dynamic: the sequences' lengths, and so their items' costs, differ */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < rows * kv_heads * batches; item++) {
            if (!slots || !p) {  /* still take part in the loop: every thread must reach it */
                failed = 1;
                continue;
            }
            const int64_t row = item / (kv_heads * batches), g = item / batches % kv_heads, batch = item % batches;
            const segment *seg = segments + segment_of[row];
            const int64_t r = row - first_of[segment_of[row]], cached = seg->cached, seg_rows = seg->rows;
            int64_t n_keys = 0;
            for (int64_t s = 0; s < cached; s++)
                if (!seg->cached_visible || seg->cached_visible[r * cached + s]) slots[n_keys++] = (int32_t)s;
            for (int64_t j = 0; j < seg_rows; j++)
                if (seg->visible[r * seg_rows + j]) slots[n_keys++] = (int32_t)(cached + j);
            const int64_t first = g * group + batch * QUERIES;
            const int64_t count = group - batch * QUERIES < QUERIES ? group - batch * QUERIES : QUERIES;
            const float *queries[QUERIES];
            float *outs[QUERIES];
            for (int64_t h = 0; h < count; h++) {
                float *query = p + QUERIES * stride + h * d;
                rope(q + row * q_row + (first + h) * q_head, cos + positions[row] * d, sin + positions[row] * d, d, query);
                queries[h] = query;
                outs[h] = out + (row * heads + first + h) * d;
            }
            const int64_t layer_cache = layer * kv_heads * seg->capacity * d;
            attend_heads(queries, count, seg->k + layer_cache + g * seg->capacity * d,
                         seg->v + layer_cache + g * seg->capacity * d, slots, n_keys, d, scale, p, stride, outs);
        }
        free(slots);
        free(p);
    }
    free(segment_of);
    free(first_of);
    return failed ? -2 : 0;
}

/* attention_segments for one sequence, k/v its cache of one layer [kv_heads, capacity, D]; cached_visible
   [rows, cached] or NULL (every cached slot). */
int attention_rows(const float *q, int64_t q_row, int64_t q_head, const float *k_new, int64_t k_row, int64_t k_head,
                   const float *v_new, int64_t v_row, int64_t v_head, const float *cos, const float *sin,
                   const int64_t *positions, uint16_t *k, uint16_t *v, int64_t capacity, int64_t heads,
                   int64_t kv_heads, int64_t d, int64_t cached, int64_t rows, const uint8_t *visible,
                   const uint8_t *cached_visible, float *out) {
    const segment one = {k, v, capacity, cached, rows, visible, cached_visible};
    return attention_segments(q, q_row, q_head, k_new, k_row, k_head, v_new, v_row, v_head, cos, sin, positions, &one,
                              1, 0, heads, kv_heads, d, out);
}
