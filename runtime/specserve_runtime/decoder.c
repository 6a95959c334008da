/* The int8 target's decoder layers, the whole stack in one call.

   Why: a decode step of SmolLM2-135M spends about as long in the torch operations and Python
   around its matrix products and attention (some 20 calls per layer, 30 layers) as in those
   kernels themselves. Here the same kernels run, with RMSNorm, SwiGLU and the residual adds
   between them, for all layers and all segments at once.

   Every operation computes each row alone, in one fixed order: RMSNorm's sum of squares, the
   int8 products (blockquant.c), attention (attention.c), the elementwise SwiGLU. So a row's bits
   are the same alone (a one-token step), in a verify block or in a batch: verification computes
   plain decoding's logits.

   A layer, x [N, H] in place:
     h = RMSNorm(x) * input_norm;  q, k, v = h @ qkv   (Qwen3: q and k heads RMSNormed too; EAGLE-3's
       layer: h = [RMSNorm(embeds) * input_norm ; RMSNorm(x) * hidden_norm], 2H wide, x its features)
     x += attention_segments(q, k, v) @ o               (RoPE, cache writes, each segment's own cache)
     h = RMSNorm(x) * post_norm;   g, u = h @ gate_up;  x += (silu(g) * u) @ down */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>

#include "kernels.h"

typedef struct {  /* a weight in the int8 layout (blockquant.Int8Blocks): q4 with minimum, or q8 */
    const uint8_t *q4, *q8;
    const float *scale, *minimum;
    int64_t n_out, k;
} int8_weight;

typedef struct {
    const float *input_norm, *post_norm, *q_norm, *k_norm;  /* q_norm, k_norm: Qwen3's, else NULL */
    const float *hidden_norm;  /* EAGLE-3's, on the features beside the normed embeddings; else NULL */
    int8_weight qkv, o, gate_up, down;
} layer_weights;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate;
    float eps;
} model_shape;

/* out[d] = x[d] / sqrt(mean(x^2) + eps) * weight[d]; d a multiple of 16. */
__attribute__((target("avx512f")))
static void rms_norm(const float *x, const float *weight, int64_t d, float eps, float *out) {
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += LANES) {
        const __m512 v = _mm512_loadu_ps(x + i);
        squares = _mm512_fmadd_ps(v, v, squares);
    }
    const __m512 inverse = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)d + eps));
    for (int64_t i = 0; i < d; i += LANES)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), inverse),
                                                _mm512_loadu_ps(weight + i)));
}

/* act[i] = silu(g[i]) * u[i], silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|) <= 1 so it never overflows:
   1 / (1 + e) for g >= 0, e / (1 + e) below. */
__attribute__((target("avx512f")))
static void swiglu(const float *g, const float *u, int64_t d, float *act) {
    for (int64_t i = 0; i < d; i += LANES) {
        const __m512 gate = _mm512_loadu_ps(g + i);
        const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gate)));
        const __mmask16 negative = _mm512_cmp_ps_mask(gate, _mm512_setzero_ps(), _CMP_LT_OQ);
        const __m512 numerator = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), negative, e);
        const __m512 sigmoid = _mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_storeu_ps(act + i, _mm512_mul_ps(_mm512_mul_ps(gate, sigmoid), _mm512_loadu_ps(u + i)));
    }
}

static void product(const float *x, int64_t rows, const int8_weight *w, float *y, int8_t *qx, float *dx, float *sx) {
    int8_product(x, rows, w->k, w->q4, w->q8, w->scale, w->minimum, w->n_out, y, qx, dx, sx);
}

static int shape_ok(const int8_weight *w, int64_t n_out, int64_t k) {
    return w->n_out == n_out && w->k == k && (w->q4 == 0) != (w->q8 == 0) && (w->q4 == 0 || w->minimum != 0);
}

/* Runs every layer over x [rows, hidden] (the segments' new rows end to end), in place; cos/sin [table_rows, D]
   the RoPE tables, positions [rows] each row's position in them; embeds [rows, hidden] or NULL: an EAGLE-3 layer's token embeddings beside x, its
   features. tapped[layer] != 0: that layer's output goes to taps [rows, n_taps * hidden], taps side by side
   in layer order. kept [rows] or NULL (all): the rows whose output the caller reads; the others only lend the
   last layer their keys and values (every row's go into the caches) and leave x as they entered that layer,
   which then runs its output projection and MLP on the kept rows alone (a prompt's logits need its last row,
   a DFlash block's only the slots it drafts). final_norm [hidden] or NULL: the model's norm after its last layer
   (epsilon final_eps), which then goes, for the kept rows in order, to normed [kept rows, hidden], the LM head's
   input: x keeps the layers' output. head NULL, or (with final_norm) the LM head, hidden wide: normed's rows also
   go through it, to logits [kept rows, head's outputs]. Why here: each return to Python between two calls runs
   interpreter and torch code the layers' products evicted from the caches (0.2 ms of a one-token step between the
   layers and the head); in one call, decodes measured about 1.02-1.03x faster. 0 on success, -1 for shapes it does
   not take (nothing written; also a kept subset with the last layer tapped), -2 when memory runs out (the caches
   may hold some of the new rows' keys: the caller drops the step). */
int decoder_layers(const layer_weights *layers, const model_shape *shape, float *x, const float *embeds,
                   int64_t rows, const float *cos, const float *sin, int64_t table_rows, const int64_t *positions,
                   const segment *segments, int64_t n_segments, const uint8_t *tapped, float *taps, const uint8_t *kept,
                   const float *final_norm, float final_eps, float *normed, const int8_weight *head, float *logits) {
    __builtin_cpu_init();
    const int64_t H = shape->hidden, D = shape->head_dim, heads = shape->heads, kv = shape->kv_heads;
    const int64_t I = shape->intermediate, width = (heads + 2 * kv) * D, in = embeds ? 2 * H : H;
    if (!__builtin_cpu_supports("avx512vnni") || H % BLOCK || (heads * D) % BLOCK || I % BLOCK || D % LANES
        || heads % kv)
        return -1;
    int64_t total = 0, n_taps = 0;
    for (int64_t s = 0; s < n_segments; s++) {
        if (segments[s].cached + segments[s].rows > segments[s].capacity) return -1;
        total += segments[s].rows;
    }
    for (int64_t l = 0; l < shape->layers; l++) {
        const layer_weights *w = layers + l;
        if (!shape_ok(&w->qkv, width, in) || !shape_ok(&w->o, H, heads * D) || !shape_ok(&w->gate_up, 2 * I, H)
            || !shape_ok(&w->down, H, I) || (w->q_norm == 0) != (w->k_norm == 0) || (w->hidden_norm != 0) != (embeds != 0))
            return -1;
        n_taps += tapped[l] != 0;
    }
    if (total != rows || (kept && tapped[shape->layers - 1])
        || (head && (!final_norm || !shape_ok(head, head->n_out, H))))
        return -1;
    for (int64_t r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= table_rows) return -1;

    int64_t widest = in;  /* the widest input of a product: the scratch for its int8 rows */
    if (I > widest) widest = I;
    if (heads * D > widest) widest = heads * D;
    float *h = malloc(rows * in * sizeof(float)), *qkv = malloc(rows * width * sizeof(float));
    float *attended = malloc(rows * heads * D * sizeof(float)), *gate_up = malloc(rows * 2 * I * sizeof(float));
    float *act = malloc(rows * I * sizeof(float)), *out = malloc(rows * H * sizeof(float));
    float *kept_x = malloc(rows * H * sizeof(float));
    int8_t *qx = malloc(rows * widest);
    float *dx = malloc(rows * (widest / BLOCK) * sizeof(float)), *sx = malloc(rows * (widest / BLOCK) * sizeof(float));
    int status = h && qkv && attended && gate_up && act && out && kept_x && qx && dx && sx ? 0 : -2;

    for (int64_t l = 0, tap = 0; l < shape->layers && status == 0; l++) {
        const layer_weights *w = layers + l;
        for (int64_t r = 0; r < rows; r++) {
            if (embeds) {
                rms_norm(embeds + r * H, w->input_norm, H, shape->eps, h + r * in);
                rms_norm(x + r * H, w->hidden_norm, H, shape->eps, h + r * in + H);
            } else {
                rms_norm(x + r * H, w->input_norm, H, shape->eps, h + r * H);
            }
        }
        product(h, rows, &w->qkv, qkv, qx, dx, sx);
        if (w->q_norm)
            for (int64_t r = 0; r < rows; r++) {
                float *row = qkv + r * width;
                for (int64_t j = 0; j < heads; j++) rms_norm(row + j * D, w->q_norm, D, shape->eps, row + j * D);
                for (int64_t j = heads; j < heads + kv; j++) rms_norm(row + j * D, w->k_norm, D, shape->eps, row + j * D);
            }
        status = attention_segments(qkv, width, D, qkv + heads * D, width, D, qkv + (heads + kv) * D, width, D, cos, sin,
                                    positions, segments, n_segments, l, heads, kv, D, attended);
        if (status != 0) break;
        /* The rest of the layer works on each row alone: in the last layer, on the kept rows only, gathered into
           kept_x (their attention outputs moved up in place), then put back. */
        float *y = x;
        int64_t n = rows;
        if (kept && l == shape->layers - 1) {
            y = kept_x;
            n = 0;
            for (int64_t r = 0; r < rows; r++)
                if (kept[r]) {
                    memcpy(y + n * H, x + r * H, H * sizeof(float));
                    memmove(attended + n * heads * D, attended + r * heads * D, heads * D * sizeof(float));
                    n++;
                }
        }
        product(attended, n, &w->o, out, qx, dx, sx);
        for (int64_t i = 0; i < n * H; i++) y[i] += out[i];
        for (int64_t r = 0; r < n; r++) rms_norm(y + r * H, w->post_norm, H, shape->eps, h + r * H);
        product(h, n, &w->gate_up, gate_up, qx, dx, sx);
        for (int64_t r = 0; r < n; r++) swiglu(gate_up + r * 2 * I, gate_up + r * 2 * I + I, I, act + r * I);
        product(act, n, &w->down, out, qx, dx, sx);
        for (int64_t i = 0; i < n * H; i++) y[i] += out[i];
        if (y != x)
            for (int64_t r = 0, j = 0; r < rows; r++)
                if (kept[r]) memcpy(x + r * H, y + j++ * H, H * sizeof(float));
        if (tapped[l]) {
            for (int64_t r = 0; r < rows; r++) memcpy(taps + (r * n_taps + tap) * H, x + r * H, H * sizeof(float));
            tap++;
        }
    }
    if (status == 0 && final_norm) {
        int64_t n = 0;
        for (int64_t r = 0; r < rows; r++)
            if (!kept || kept[r]) rms_norm(x + r * H, final_norm, H, final_eps, normed + n++ * H);
        if (head) product(normed, n, head, logits, qx, dx, sx);
    }
    free(h); free(qkv); free(attended); free(gate_up); free(act); free(out); free(kept_x); free(qx); free(dx);
    free(sx);
    return status;
}

/* A DFlash drafter's context: the target's tapped features of `rows` newly committed tokens [rows, k] ->
   h = RMSNorm(features @ fc) * hidden_norm, the same vectors for every layer -> per layer, their keys (Qwen3's
   k_norm, RoPE at positions cached.. of the tables cos/sin [table_rows, D]) and values into the cache [layers,
   kv_heads, capacity, D] at slots cached.. (the caller advances its length). Only the k/v groups of each fused q/k/v product are read: the context
   rows' queries are never used. 0 on success, -1 for shapes it does not take, -2 when memory runs out. */
int dflash_context(const layer_weights *layers, const model_shape *shape, const int8_weight *fc,
                   const float *hidden_norm, const float *features, int64_t rows, const float *cos, const float *sin,
                   int64_t table_rows, uint16_t *k, uint16_t *v, int64_t capacity, int64_t cached) {
    __builtin_cpu_init();
    const int64_t H = shape->hidden, D = shape->head_dim, heads = shape->heads, kv = shape->kv_heads;
    if (!__builtin_cpu_supports("avx512vnni") || !shape_ok(fc, H, fc->k) || fc->k % BLOCK || H % BLOCK
        || D % LANES || (heads * D) % GROUP || cached + rows > capacity || cached + rows > table_rows)
        return -1;
    for (int64_t l = 0; l < shape->layers; l++)
        if (!shape_ok(&layers[l].qkv, (heads + 2 * kv) * D, H)) return -1;
    const int64_t widest = fc->k > H ? fc->k : H, blocks = H / BLOCK, skipped = heads * D / GROUP;
    float *projected = malloc(rows * H * sizeof(float)), *h = malloc(rows * H * sizeof(float));
    float *kv_rows = malloc(rows * 2 * kv * D * sizeof(float));
    int8_t *qx = malloc(rows * widest);
    float *dx = malloc(rows * (widest / BLOCK) * sizeof(float)), *sx = malloc(rows * (widest / BLOCK) * sizeof(float));
    int64_t *positions = malloc(rows * sizeof(int64_t));
    const int status = projected && h && kv_rows && qx && dx && sx && positions ? 0 : -2;
    if (status == 0) {
        for (int64_t r = 0; r < rows; r++) positions[r] = cached + r;
        product(features, rows, fc, projected, qx, dx, sx);
        for (int64_t r = 0; r < rows; r++) rms_norm(projected + r * H, hidden_norm, H, shape->eps, h + r * H);
        for (int64_t l = 0; l < shape->layers; l++) {
            /* the k/v outputs of the fused product: its groups after the queries' (int8 layout: per group of 16
               outputs, its blocks' bytes, scales and minimums one after another) */
            const int8_weight *qkv = &layers[l].qkv;
            const int64_t bytes = qkv->q4 ? 4 * 64 : 8 * 64;
            const int8_weight kv_part = {
                qkv->q4 ? qkv->q4 + skipped * blocks * bytes : 0, qkv->q8 ? qkv->q8 + skipped * blocks * bytes : 0,
                qkv->scale + skipped * blocks * GROUP, qkv->minimum ? qkv->minimum + skipped * blocks * GROUP : 0,
                2 * kv * D, H};
            product(h, rows, &kv_part, kv_rows, qx, dx, sx);
            if (layers[l].k_norm)
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t g = 0; g < kv; g++) {
                        float *key = kv_rows + r * 2 * kv * D + g * D;
                        rms_norm(key, layers[l].k_norm, D, shape->eps, key);
                    }
            const int64_t layer_cache = l * kv * capacity * D;
            store_keys_values(kv_rows, 2 * kv * D, D, kv_rows + kv * D, 2 * kv * D, D, cos, sin, positions,
                              k + layer_cache, v + layer_cache, capacity, kv, D, cached, rows);
        }
    }
    free(projected); free(h); free(kv_rows); free(qx); free(dx); free(sx); free(positions);
    return status;
}
