/* What blockquant.c, attention.c and decoder.c share: one library (blockquant.py builds them together). */

#ifndef SPECSERVE_KERNELS_H
#define SPECSERVE_KERNELS_H

#include <stdint.h>
#include <immintrin.h>

#define BLOCK 32  /* weights (and int8 activations) per quantisation block */
#define GROUP 16  /* outputs per int8 group: the 16 int32 lanes of an AVX-512 register */
#define LANES 16  /* floats per AVX-512 register */

/* y[rows, n_out] = x[rows, k] rounded to int8 per block of 32 (into the scratch qx [rows * k] and dx, sx
   [rows * k / 32]) times weights in the int8 layout (blockquant.c, "int8 activations"); AVX-512 VNNI. */
void int8_product(const float *x, int64_t rows, int64_t k, const uint8_t *q4, const uint8_t *q8, const float *scale,
                  const float *minimum, int64_t n_out, float *y, int8_t *qx, float *dx, float *sx);

/* The caches hold keys and values as float16 bits (half the bytes to read a step; attention.c), rounded to nearest. */
#define ROUND_HALF (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* RoPE: cos/sin [positions, D] are the whole tables, and positions[r] each new row's position in them. */
void store_keys_values(const float *k_new, int64_t k_row, int64_t k_head, const float *v_new, int64_t v_row,
                       int64_t v_head, const float *cos, const float *sin, const int64_t *positions, uint16_t *k,
                       uint16_t *v, int64_t capacity, int64_t kv_heads, int64_t d, int64_t cached, int64_t rows);

typedef struct {  /* one sequence's new rows, laid end to end with the others' */
    uint16_t *k, *v;  /* its cache, [layers, kv_heads, capacity, D] each, float16 */
    int64_t capacity, cached, rows;
    const uint8_t *visible;  /* [rows, rows]: the new tokens each new token sees (attention.c) */
    const uint8_t *cached_visible;  /* [rows, cached]: the cached slots each sees, or NULL: all (attention.c) */
} segment;

int attention_segments(const float *q, int64_t q_row, int64_t q_head, const float *k_new, int64_t k_row,
                       int64_t k_head, const float *v_new, int64_t v_row, int64_t v_head, const float *cos,
                       const float *sin, const int64_t *positions, const segment *segments, int64_t n_segments,
                       int64_t layer, int64_t heads, int64_t kv_heads, int64_t d, float *out);

int attention_rows(const float *q, int64_t q_row, int64_t q_head, const float *k_new, int64_t k_row, int64_t k_head,
                   const float *v_new, int64_t v_row, int64_t v_head, const float *cos, const float *sin,
                   const int64_t *positions, uint16_t *k, uint16_t *v, int64_t capacity, int64_t heads,
                   int64_t kv_heads, int64_t d, int64_t cached, int64_t rows, const uint8_t *visible,
                   const uint8_t *cached_visible, float *out);

/* exp(x) for x <= 0: Cephes' expf, a range reduction by ln 2 and its polynomial (tests hold the
   attention to SDPA's and the decoder layers to torch's within 1e-5). Below -87.3 the result is
   about 2^-126, not 0: as a softmax weight or a sigmoid's e^-|x|, nothing anyway. */
__attribute__((target("avx512f")))
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);  /* p * 2^n */
}

/* x [d] rotated by RoPE (Hugging Face's rotate-half convention) at the position whose tables are cos/sin [d]. */
static inline void rope(const float *x, const float *cos, const float *sin, int64_t d, float *out) {
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i++) {
        out[i] = x[i] * cos[i] - x[i + half] * sin[i];
        out[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
    }
}

#endif
