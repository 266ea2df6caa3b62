/*
 * The softmax attention inside small families of leaf rows, float32, fused with the
 * families' sums of q, k and v: one pass over each family's rows while they are in cache
 * (hsa_graph/ops/native.py builds and calls it, and says when). Written with GCC / Clang
 * vector extensions (16 floats: one AVX-512 register, two AVX2 or four SSE / NEON
 * registers where the target has less), no intrinsics.
 *
 * Family f has b <= 64 slots; slot j reads the rows of q, k [N, H, D] and v [N, H, Dv]
 * at row rows_in[f, j] (f * b + j without rows_in) and writes out [R, H, Dv] at row
 * rows_out[f, j] (likewise); rows `row_*` and heads `head_*` floats apart, features
 * dense. Per family and head, with s = scale and c_j the key bias (0 without one; -inf
 * on padding slots, which are neither attended to nor summed):
 *
 *     logits[i, j] = s <q_i, k_j> + c_j     (-inf on the diagonal unless include_self)
 *     lse[f, h, i] = log sum_j exp(logits[i, j])
 *     out_i        = sum_j exp(logits[i, j] - lse_i) v_j
 *     sum_q[f, h]  = sum_i q_i,  sum_k[f, h] = sum_j k_j,  sum_v[f, h] = sum_j v_j
 *
 * A row whose every key is masked (b = 1 without include_self) gets lse = -inf and
 * out = 0; a row with a NaN logit gets NaN. Requires D and Dv multiples of 16 and
 * D <= 1024 (checked by the caller), queries taken 16 at a time (a vector's lanes).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

#define LANES 16
#define MAX_D 1024
#define MAX_FAMILY 64

static inline vf load(const float *p) { vf x; memcpy(&x, p, sizeof x); return x; }
static inline void store(float *p, vf x) { memcpy(p, &x, sizeof x); }
static inline vf splat(float a) { return (vf){a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a}; }
static inline vi as_int(vf x) { vi i; memcpy(&i, &x, sizeof i); return i; }
static inline vf as_float(vi i) { vf x; memcpy(&x, &i, sizeof x); return x; }
/* where(mask, a, b), mask lanes all ones or all zeros (a vector comparison's result) */
static inline vf where(vi mask, vf a, vf b) { return as_float((as_int(a) & mask) | (as_int(b) & ~mask)); }

/* exp(x) to about 2 ulp: x = n ln2 + r, |r| <= ln2 / 2, 2^n from the exponent bits and
 * e^r by its Taylor polynomial of degree 7; 0 below -87 (and at -inf), NaN kept. */
static inline vf vexp(vf x) {
    const vi small = x < splat(-87.0f);
    const vi nan = x != x;
    x = where(small | nan, splat(0.0f), x);
    x = where(x > splat(88.0f), splat(88.0f), x);
    const vf t = x * splat(1.44269504088896341f);
    vf n = __builtin_convertvector(__builtin_convertvector(t, vi), vf);   /* trunc */
    n = where(n - t > splat(0.5f), n - splat(1.0f), n);                     /* round */
    n = where(t - n > splat(0.5f), n + splat(1.0f), n);
    const vf r = x - n * splat(0.693145751953125f) - n * splat(1.42860682030941723e-06f);
    vf p = splat(1.0f / 5040.0f);
    p = p * r + splat(1.0f / 720.0f);
    p = p * r + splat(1.0f / 120.0f);
    p = p * r + splat(1.0f / 24.0f);
    p = p * r + splat(1.0f / 6.0f);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    p = p * as_float((__builtin_convertvector(n, vi) + 127) << 23);
    return where(nan, splat(NAN), where(small, splat(0.0f), p));
}

/* log(x) for normal x > 0: x = 2^e m, m in [1, 2), log m = 2 atanh((m - 1) / (m + 1)) */
static inline vf vlog(vf x) {
    const vi bits = as_int(x);
    const vf e = __builtin_convertvector(((bits >> 23) & 0xff) - 127, vf);
    const vf m = as_float((bits & 0x007fffff) | 0x3f800000);
    const vf t = (m - splat(1.0f)) / (m + splat(1.0f)), t2 = t * t;
    vf p = splat(1.0f / 13.0f);
    p = p * t2 + splat(1.0f / 11.0f);
    p = p * t2 + splat(1.0f / 9.0f);
    p = p * t2 + splat(1.0f / 7.0f);
    p = p * t2 + splat(1.0f / 5.0f);
    p = p * t2 + splat(1.0f / 3.0f);
    p = p * t2 + splat(1.0f);
    return e * splat(0.693147180559945309f) + splat(2.0f) * t * p;
}

/* rows r[0 .. 15] of a 16 x 16 block -> its transpose: four butterfly stages, stage S
 * swapping bit S of the row index with bit S of the column index */
static inline void transpose16(vf *r) {
    for (int a = 0; a < LANES; ++a) {
        if (a & 1) continue;
        const vf x = r[a], y = r[a | 1];
        r[a] = __builtin_shufflevector(x, y, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
        r[a | 1] = __builtin_shufflevector(x, y, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    }
    for (int a = 0; a < LANES; ++a) {
        if (a & 2) continue;
        const vf x = r[a], y = r[a | 2];
        r[a] = __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
        r[a | 2] = __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    }
    for (int a = 0; a < LANES; ++a) {
        if (a & 4) continue;
        const vf x = r[a], y = r[a | 4];
        r[a] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
        r[a | 4] = __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    }
    for (int a = 0; a < LANES; ++a) {
        if (a & 8) continue;
        const vf x = r[a], y = r[a | 8];
        r[a] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
        r[a | 8] = __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    }
}

/* xt[d][r] = rows[r][d] for `count` <= 16 rows of `width` floats (lanes past `count`
 * zero): a block of rows transposed, 16 features at a time */
static inline void transpose_rows(vf *xt, const float *const *rows, int64_t count,
                                  int64_t width) {
    for (int64_t d0 = 0; d0 < width; d0 += LANES) {
        vf *block = xt + d0;
        for (int64_t r = 0; r < count; ++r) block[r] = load(rows[r] + d0);
        for (int64_t r = count; r < LANES; ++r) block[r] = splat(0.0f);
        transpose16(block);
    }
}

/* out[r] = sum_d rows[r][d] xt[d] for four rows against a transposed block xt (lane c:
 * the block's column c): two accumulators per row, eight independent FMA chains */
static inline void dot4(const vf *xt, const float *const *rows, int64_t width, vf *out) {
    vf a0 = splat(0.0f), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    for (int64_t d = 0; d < width; d += 2) {
        const vf x = xt[d], y = xt[d + 1];
        a0 += splat(rows[0][d]) * x; c0 += splat(rows[0][d + 1]) * y;
        a1 += splat(rows[1][d]) * x; c1 += splat(rows[1][d + 1]) * y;
        a2 += splat(rows[2][d]) * x; c2 += splat(rows[2][d + 1]) * y;
        a3 += splat(rows[3][d]) * x; c3 += splat(rows[3][d + 1]) * y;
    }
    out[0] = a0 + c0; out[1] = a1 + c1; out[2] = a2 + c2; out[3] = a3 + c3;
}

/* one family, one head: see the top of the file. q[j], k[j], v[j], out[j]: slot j's rows
 * (this head's features; out[j] NULL: no row written); bias[j]: the slot's key bias (-inf
 * on padding, whose rows are read but neither attended to nor summed); sums may be NULL. */
static void family_head(const float *const *q, const float *const *k, const float *const *v,
                        float *const *out, const float *bias, float *lse, float *sum_q,
                        float *sum_k, float *sum_v, int64_t b, int64_t D, int64_t Dv,
                        float scale, int include_self) {
    vf qt[MAX_D];             /* qt[d][r] = q_{i0 + r}[d]: a block of queries transposed */
    vf logit[MAX_FAMILY];     /* logit[j][r]: query i0 + r on key j, then probabilities */
    if (sum_q != NULL) {
        for (int64_t d0 = 0; d0 < D; d0 += LANES) {
            vf total_q = splat(0.0f), total_k = splat(0.0f);
            for (int64_t j = 0; j < b; ++j) {
                if (bias[j] == -INFINITY) continue;
                total_q += load(q[j] + d0);
                total_k += load(k[j] + d0);
            }
            store(sum_q + d0, total_q);
            store(sum_k + d0, total_k);
        }
        for (int64_t d0 = 0; d0 < Dv; d0 += LANES) {
            vf total = splat(0.0f);
            for (int64_t j = 0; j < b; ++j)
                if (bias[j] != -INFINITY) total += load(v[j] + d0);
            store(sum_v + d0, total);
        }
    }
    for (int64_t i0 = 0; i0 < b; i0 += LANES) {
        const int64_t queries = b - i0 < LANES ? b - i0 : LANES;
        transpose_rows(qt, q + i0, queries, D);
        /* four keys at a time */
        for (int64_t j0 = 0; j0 < b; j0 += 4) {
            const float *key[4];
            for (int r = 0; r < 4; ++r) key[r] = k[j0 + r < b ? j0 + r : j0];
            vf sums[4];
            dot4(qt, key, D, sums);
            for (int r = 0; r < 4 && j0 + r < b; ++r)
                logit[j0 + r] = sums[r] * splat(scale) + splat(bias[j0 + r]);
        }
        if (!include_self)
            for (int64_t r = 0; r < queries; ++r) logit[i0 + r][r] = -INFINITY;
        /* the softmax of the block's queries at once: lane r is query i0 + r */
        vf top = logit[0];
        vi nan = logit[0] != logit[0];
        for (int64_t j = 1; j < b; ++j) {
            top = where(logit[j] > top, logit[j], top);
            nan |= logit[j] != logit[j];
        }
        top = where(top == splat(-INFINITY), splat(0.0f), top);
        vf total = splat(0.0f);
        for (int64_t j = 0; j < b; ++j) {
            logit[j] = vexp(logit[j] - top);
            total += logit[j];
        }
        const vi some = total > splat(0.0f);
        vf row_lse = where(some, top + vlog(where(some, total, splat(1.0f))), splat(-INFINITY));
        row_lse = where(nan, splat(NAN), row_lse);
        memcpy(lse + i0, &row_lse, (size_t)queries * sizeof(float));
        vf inverse = where(some, splat(1.0f) / where(some, total, splat(1.0f)), splat(0.0f));
        inverse = where(nan, splat(NAN), inverse);
        for (int64_t j = 0; j < b; ++j) logit[j] *= inverse;
        /* out_i = sum_j p_ij v_j, 16 features at a time, four queries at a time */
        for (int64_t d0 = 0; d0 < Dv; d0 += LANES) {
            for (int64_t r0 = 0; r0 < queries; r0 += 4) {
                const int64_t n = queries - r0 < 4 ? queries - r0 : 4;
                int64_t lane[4];
                for (int r = 0; r < 4; ++r) lane[r] = r0 + (r < n ? r : 0);
                vf o0 = splat(0.0f), o1 = o0, o2 = o0, o3 = o0;
                for (int64_t j = 0; j < b; ++j) {
                    const vf x = load(v[j] + d0);
                    o0 += splat(logit[j][lane[0]]) * x;
                    o1 += splat(logit[j][lane[1]]) * x;
                    o2 += splat(logit[j][lane[2]]) * x;
                    o3 += splat(logit[j][lane[3]]) * x;
                }
                const vf o[4] = {o0, o1, o2, o3};
                for (int r = 0; r < n; ++r)
                    if (out[i0 + lane[r]] != NULL) store(out[i0 + lane[r]] + d0, o[r]);
            }
        }
    }
}

/* Families 0 .. F - 1 of b slots, split over `threads` OpenMP threads where built with
 * OpenMP. Slot j of family f reads row rows_in[f * b + j] of q, k, v (row f * b + j
 * where rows_in is NULL) and writes row rows_out[f * b + j] of out (likewise), with key
 * bias key_bias[f * b + j] (0 where NULL). lse: [F, H, b]; sum_q, sum_k: [R, H, D] and
 * sum_v: [R, H, Dv], dense, family f's sums at row sum_rows[f] (row f where NULL;
 * sum_q NULL: no sums). */
void hsa_family_attention_f32(const float *q, const float *k, const float *v, float *out,
                              float *lse, float *sum_q, float *sum_k, float *sum_v,
                              const int64_t *rows_in, const int64_t *rows_out,
                              const int64_t *sum_rows,
                              const float *key_bias, int64_t F, int64_t b, int64_t H,
                              int64_t D, int64_t Dv, int64_t row_q, int64_t head_q,
                              int64_t row_k, int64_t head_k, int64_t row_v, int64_t head_v,
                              int64_t row_out, int64_t head_out, float scale,
                              int include_self, int threads) {
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && F > 1)
    for (int64_t f = 0; f < F; ++f) {
        const float *qs[MAX_FAMILY], *ks[MAX_FAMILY], *vs[MAX_FAMILY];
        float *outs[MAX_FAMILY], bias[MAX_FAMILY];
        if (f + 1 < F)   /* the next family's rows on their way while this one computes */
            for (int64_t j = 0; j < b; ++j) {
                const int64_t row = rows_in ? rows_in[(f + 1) * b + j] : (f + 1) * b + j;
                for (int64_t h = 0; h < H; ++h) {
                    for (int64_t c = 0; c < D; c += LANES) {
                        __builtin_prefetch(q + row * row_q + h * head_q + c);
                        __builtin_prefetch(k + row * row_k + h * head_k + c);
                    }
                    for (int64_t c = 0; c < Dv; c += LANES)
                        __builtin_prefetch(v + row * row_v + h * head_v + c);
                }
            }
        for (int64_t h = 0; h < H; ++h) {
            for (int64_t j = 0; j < b; ++j) {
                const int64_t src = rows_in ? rows_in[f * b + j] : f * b + j;
                const int64_t dst = rows_out ? rows_out[f * b + j] : f * b + j;
                qs[j] = q + src * row_q + h * head_q;
                ks[j] = k + src * row_k + h * head_k;
                vs[j] = v + src * row_v + h * head_v;
                /* padding slots write no row where rows share a spare destination */
                outs[j] = rows_out && key_bias && key_bias[f * b + j] == -INFINITY
                              ? NULL : out + dst * row_out + h * head_out;
                bias[j] = key_bias ? key_bias[f * b + j] : 0.0f;
            }
            const int64_t at = f * H + h, sum_at = (sum_rows ? sum_rows[f] : f) * H + h;
            family_head(qs, ks, vs, outs, bias, lse + at * b,
                        sum_q ? sum_q + sum_at * D : NULL, sum_q ? sum_k + sum_at * D : NULL,
                        sum_q ? sum_v + sum_at * Dv : NULL, b, D, Dv, scale, include_self);
        }
    }
}

/* dst += sum_r weight[r] rows[r] over `count` rows of `width` floats: 64 features at a
 * time held in registers while the rows add into them */
static inline void add_weighted_rows(float *dst, const float *const *rows,
                                     const float *weight, int64_t count, int64_t width) {
    for (int64_t d0 = 0; d0 < width; d0 += 4 * LANES) {
        const int64_t w = width - d0 < 4 * LANES ? (width - d0) / LANES : 4;
        vf acc[4];
        for (int64_t c = 0; c < w; ++c) acc[c] = load(dst + d0 + c * LANES);
        for (int64_t r = 0; r < count; ++r) {
            const vf s = splat(weight[r]);
            for (int64_t c = 0; c < w; ++c) acc[c] += s * load(rows[r] + d0 + c * LANES);
        }
        for (int64_t c = 0; c < w; ++c) store(dst + d0 + c * LANES, acc[c]);
    }
}

/* The gradients of family_head's softmax attention, one family and head, recomputing
 * P = exp(S - lse) from q, k and the forward's log-sum-exp (b slots, no padding, key
 * bias 0). With dO the outputs' gradient, D_i = <dO_i, o_i> and dl the log-sum-exp's
 * gradient (NULL: 0):
 *
 *     dP_ij = <dO_i, v_j>,   dS_ij = P_ij (dP_ij - D_i + dl_i)
 *     dq_i = s sum_j dS_ij k_j,   dk_j = s sum_i dS_ij q_i,   dv_j = sum_i P_ij dO_i
 *
 * plus g_q, g_k, g_v (the gradients of the family's sums of q, k, v; NULL: 0) on every
 * row. dq, dk, dv[j]: slot j's gradient rows, written (dk, dv accumulated in place
 * after their first write). */
static void family_head_backward(const float *const *q, const float *const *k,
                                 const float *const *v, const float *const *o,
                                 const float *const *d_o, const float *lse,
                                 const float *d_lse, const float *g_q, const float *g_k,
                                 const float *g_v, float *const *dq, float *const *dk,
                                 float *const *dv, int64_t b, int64_t D, int64_t Dv,
                                 float scale, int include_self) {
    vf qt[MAX_D];             /* a block of queries transposed, as in family_head */
    vf dot[MAX_D];            /* the block's output gradients transposed */
    vf dqt[MAX_D];            /* the block's query gradients, transposed */
    vf p[MAX_FAMILY], ds[MAX_FAMILY];
    for (int64_t j = 0; j < b; ++j) {
        for (int64_t d0 = 0; d0 < D; d0 += LANES)
            store(dk[j] + d0, g_k ? load(g_k + d0) : splat(0.0f));
        for (int64_t d0 = 0; d0 < Dv; d0 += LANES)
            store(dv[j] + d0, g_v ? load(g_v + d0) : splat(0.0f));
    }
    for (int64_t i0 = 0; i0 < b; i0 += LANES) {
        const int64_t queries = b - i0 < LANES ? b - i0 : LANES;
        transpose_rows(qt, q + i0, queries, D);
        transpose_rows(dot, d_o + i0, queries, Dv);
        for (int64_t d = 0; d < D; ++d) dqt[d] = splat(0.0f);
        float row_lse[LANES], row_shift[LANES];
        for (int64_t r = 0; r < LANES; ++r) {
            row_lse[r] = r < queries ? lse[i0 + r] : INFINITY;   /* P = 0 off the block */
            float delta = 0.0f;
            if (r < queries) {
                vf acc = splat(0.0f);
                for (int64_t d0 = 0; d0 < Dv; d0 += LANES)
                    acc += load(d_o[i0 + r] + d0) * load(o[i0 + r] + d0);
                for (int c = 0; c < LANES; ++c) delta += acc[c];
            }
            row_shift[r] = (d_lse && r < queries ? d_lse[i0 + r] : 0.0f) - delta;
        }
        vf lse_v, shift_v;
        memcpy(&lse_v, row_lse, sizeof lse_v);
        memcpy(&shift_v, row_shift, sizeof shift_v);
        /* a row whose every key was masked (lse -inf) has P = 0 */
        const vi dead = lse_v == splat(-INFINITY);
        /* logits and dP four keys at a time */
        for (int64_t j0 = 0; j0 < b; j0 += 4) {
            const float *key[4], *value[4];
            for (int r = 0; r < 4; ++r) {
                key[r] = k[j0 + r < b ? j0 + r : j0];
                value[r] = v[j0 + r < b ? j0 + r : j0];
            }
            vf logits[4], dps[4];
            dot4(qt, key, D, logits);
            dot4(dot, value, Dv, dps);
            for (int r = 0; r < 4 && j0 + r < b; ++r) {
                const int64_t j = j0 + r;
                vf pj = vexp(logits[r] * splat(scale) - lse_v);
                pj = where(dead, splat(0.0f), pj);
                if (!include_self && j >= i0 && j < i0 + queries) pj[j - i0] = 0.0f;
                p[j] = pj;
                ds[j] = pj * (dps[r] + shift_v) * splat(scale);
            }
        }
        /* dq (transposed, accumulated over the keys), then dk and dv row by row: each
         * key's rows held in registers while the block's queries add into them */
        for (int64_t j = 0; j < b; ++j) {
            const vf sj = ds[j];
            for (int64_t d = 0; d < D; ++d) dqt[d] += sj * splat(k[j][d]);
        }
        for (int64_t j = 0; j < b; ++j) {
            float sj[LANES], pj[LANES];
            memcpy(sj, &ds[j], sizeof sj);
            memcpy(pj, &p[j], sizeof pj);
            add_weighted_rows(dk[j], q + i0, sj, queries, D);
            add_weighted_rows(dv[j], d_o + i0, pj, queries, Dv);
        }
        for (int64_t d0 = 0; d0 < D; d0 += LANES) {
            transpose16(dqt + d0);
            for (int64_t r = 0; r < queries; ++r)
                store(dq[i0 + r] + d0, g_q ? dqt[d0 + r] + load(g_q + d0) : dqt[d0 + r]);
        }
    }
}

/* The backward of hsa_family_attention_f32 over families of b consecutive rows
 * (no rows_in, no key bias): q, k, v, o, d_o rows `row_*` and heads `head_*` floats
 * apart; dq, dk [N, H, D] and dv [N, H, Dv] dense, written whole; lse, d_lse [F, H, b]
 * (d_lse NULL: 0); g_q, g_k [F, H, D], g_v [F, H, Dv] dense (NULL: 0). Families split
 * over `threads` OpenMP threads. */
void hsa_family_attention_backward_f32(
        const float *q, const float *k, const float *v, const float *o, const float *d_o,
        const float *lse, const float *d_lse, const float *g_q, const float *g_k,
        const float *g_v, float *dq, float *dk, float *dv, int64_t F, int64_t b, int64_t H,
        int64_t D, int64_t Dv, int64_t row_q, int64_t head_q, int64_t row_k, int64_t head_k,
        int64_t row_v, int64_t head_v, int64_t row_o, int64_t head_o, int64_t row_do,
        int64_t head_do, float scale, int include_self, int threads) {
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && F > 1)
    for (int64_t f = 0; f < F; ++f) {
        const float *qs[MAX_FAMILY], *ks[MAX_FAMILY], *vs[MAX_FAMILY], *os[MAX_FAMILY],
            *dos[MAX_FAMILY];
        float *dqs[MAX_FAMILY], *dks[MAX_FAMILY], *dvs[MAX_FAMILY];
        for (int64_t h = 0; h < H; ++h) {
            for (int64_t j = 0; j < b; ++j) {
                const int64_t row = f * b + j;
                qs[j] = q + row * row_q + h * head_q;
                ks[j] = k + row * row_k + h * head_k;
                vs[j] = v + row * row_v + h * head_v;
                os[j] = o + row * row_o + h * head_o;
                dos[j] = d_o + row * row_do + h * head_do;
                dqs[j] = dq + (row * H + h) * D;
                dks[j] = dk + (row * H + h) * D;
                dvs[j] = dv + (row * H + h) * Dv;
            }
            const int64_t at = f * H + h;
            family_head_backward(qs, ks, vs, os, dos, lse + at * b,
                                 d_lse ? d_lse + at * b : NULL, g_q ? g_q + at * D : NULL,
                                 g_k ? g_k + at * D : NULL, g_v ? g_v + at * Dv : NULL, dqs,
                                 dks, dvs, b, D, Dv, scale, include_self);
        }
    }
}
