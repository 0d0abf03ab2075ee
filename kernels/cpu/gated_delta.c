/* Gated delta rule on the CPU for baton (built at first use by kernels/cpu/gated_delta.py).
 *
 * The recurrence of kernels/gated_delta.py, token by token, on the state in its pool slot:
 *   S <- exp(g) S;  delta = beta (v - k^T S);  S <- S + k delta^T;  o = q^T S
 * rewritten so that each token reads the state twice and writes it once:
 *   pass 1:  kv = k^T S,  qs = q^T S                         (S as it stood, before the decay)
 *            delta = beta (v - e kv),  o = e qs + (q . k) delta     (e = exp(g))
 *   pass 2:  S <- e S + k delta^T
 * The columns of a head's state (k_head_dim x v_head_dim, float32) evolve independently (every
 * term above is per column), so a task is one (sequence, v head, block of BV columns): its
 * k_head_dim x BV block (16 KB for k_head_dim 128) stays in L1 across the sequence's tokens, and
 * the tasks need no synchronisation. The chunked form of the torch path pays a triangular solve
 * and L x L products per chunk to turn this into matmuls; on the CPU the plain recurrence over an
 * L1-resident block does no more flops and ran 2-4x faster on one thread (bench/kernels/gdn_kernels.py).
 *
 * Prefill also copies the block into chunk_states at every end of an aligned chunk (the chunk
 * grid of kernels/ssd.py: sequence s's first chunk holds chunk - start_pos[s] % chunk tokens) and
 * at the sequence's last token; chunks past the sequence's end repeat its final state.
 * Rows whose slot is 0 are decode padding when skip_padding is set: no read, no write, o = 0.
 * Slots are checked before anything is written: the first bad row + 1 is returned, else 0.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define BV 32 /* state columns per task */

#if defined(__AVX512F__)
#include <immintrin.h>

/* gdn_token on a full block of BV = 32 columns: two vectors per state row, the pass-1 sums in
 * eight registers (rows two at a time, so four FMA chains per sum hide the FMA latency), explicit
 * FMAs (ISO C mode does not contract a * b + c). */
static inline __attribute__((always_inline)) void gdn_token_full(float *S, int64_t ld,
                                                                 const float *qn, const float *kn,
                                                                 float qk, const float *v, float e,
                                                                 float beta, float *o, int64_t dk) {
    __m512 kv[4], qs[4];
    for (int j = 0; j < 4; j++) kv[j] = qs[j] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 2 <= dk; i += 2) {
        for (int r = 0; r < 2; r++) {
            const float *row = S + (i + r) * ld;
            const __m512 r0 = _mm512_loadu_ps(row), r1 = _mm512_loadu_ps(row + 16);
            const __m512 ki = _mm512_set1_ps(kn[i + r]), qi = _mm512_set1_ps(qn[i + r]);
            kv[2 * r] = _mm512_fmadd_ps(ki, r0, kv[2 * r]);
            kv[2 * r + 1] = _mm512_fmadd_ps(ki, r1, kv[2 * r + 1]);
            qs[2 * r] = _mm512_fmadd_ps(qi, r0, qs[2 * r]);
            qs[2 * r + 1] = _mm512_fmadd_ps(qi, r1, qs[2 * r + 1]);
        }
    }
    if (i < dk) {
        const float *row = S + i * ld;
        const __m512 r0 = _mm512_loadu_ps(row), r1 = _mm512_loadu_ps(row + 16);
        const __m512 ki = _mm512_set1_ps(kn[i]), qi = _mm512_set1_ps(qn[i]);
        kv[0] = _mm512_fmadd_ps(ki, r0, kv[0]);
        kv[1] = _mm512_fmadd_ps(ki, r1, kv[1]);
        qs[0] = _mm512_fmadd_ps(qi, r0, qs[0]);
        qs[1] = _mm512_fmadd_ps(qi, r1, qs[1]);
    }
    const __m512 ev = _mm512_set1_ps(e), bv = _mm512_set1_ps(beta), qkv = _mm512_set1_ps(qk);
    __m512 delta[2];
    for (int h = 0; h < 2; h++) {
        const __m512 kvh = _mm512_add_ps(kv[h], kv[h + 2]), qsh = _mm512_add_ps(qs[h], qs[h + 2]);
        /* delta = beta (v - e kv);  o = e qs + (q . k) delta */
        delta[h] = _mm512_mul_ps(bv, _mm512_fnmadd_ps(ev, kvh, _mm512_loadu_ps(v + 16 * h)));
        _mm512_storeu_ps(o + 16 * h, _mm512_fmadd_ps(qkv, delta[h], _mm512_mul_ps(ev, qsh)));
    }
    for (i = 0; i < dk; i++) {
        float *row = S + i * ld;
        const __m512 ki = _mm512_set1_ps(kn[i]);
        _mm512_storeu_ps(row, _mm512_fmadd_ps(ki, delta[0], _mm512_mul_ps(ev, _mm512_loadu_ps(row))));
        _mm512_storeu_ps(row + 16,
                         _mm512_fmadd_ps(ki, delta[1], _mm512_mul_ps(ev, _mm512_loadu_ps(row + 16))));
    }
}
#endif

/* One token on an nc-column block of one head's state S (rows dk, row stride ld):
 * qn, kn normalised (qn scaled), qk = qn . kn; v, o the block's nc columns. */
static inline __attribute__((always_inline)) void gdn_token(float *S, int64_t ld, const float *qn,
                                                            const float *kn, float qk,
                                                            const float *v, float e, float beta,
                                                            float *o, int64_t dk, const int64_t nc) {
#if defined(__AVX512F__)
    if (nc == BV) {
        gdn_token_full(S, ld, qn, kn, qk, v, e, beta, o, dk);
        return;
    }
#endif
    float kv[BV], qs[BV], delta[BV];
#pragma omp simd
    for (int64_t c = 0; c < nc; c++) kv[c] = qs[c] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        const float *row = S + i * ld;
        const float ki = kn[i], qi = qn[i];
#pragma omp simd
        for (int64_t c = 0; c < nc; c++) {
            kv[c] += ki * row[c];
            qs[c] += qi * row[c];
        }
    }
#pragma omp simd
    for (int64_t c = 0; c < nc; c++) {
        delta[c] = beta * (v[c] - e * kv[c]);
        o[c] = e * qs[c] + qk * delta[c];
    }
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * ld;
        const float ki = kn[i];
#pragma omp simd
        for (int64_t c = 0; c < nc; c++) row[c] = e * row[c] + ki * delta[c];
    }
}

/* l2-normalise q (then scale it by dk^-1/2) and k of one token and key head into qn, kn; returns
 * qn . kn. eps 1e-6 inside the root, as transformers' l2norm. */
static inline float normalise_qk(const float *q, const float *k, float *qn, float *kn, int64_t dk) {
    float sq = 0.0f, sk = 0.0f;
#pragma omp simd reduction(+ : sq, sk)
    for (int64_t i = 0; i < dk; i++) {
        sq += q[i] * q[i];
        sk += k[i] * k[i];
    }
    const float rq = 1.0f / sqrtf(sq + 1e-6f) / sqrtf((float)dk), rk = 1.0f / sqrtf(sk + 1e-6f);
    float qk = 0.0f;
#pragma omp simd reduction(+ : qk)
    for (int64_t i = 0; i < dk; i++) {
        qn[i] = q[i] * rq;
        kn[i] = k[i] * rk;
        qk += qn[i] * kn[i];
    }
    return qk;
}

/* One (sequence, v head, column block) task of baton_gdn_scan. */
static inline __attribute__((always_inline)) void scan_block(
    const float *qkn, const float *v, const float *g, const float *beta, float *S, float *o,
    float *cstates, int64_t t0, int64_t n, int64_t offset, int64_t chunk, int64_t num_chunks_out,
    int64_t h, int64_t R, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t c0,
    const int64_t nc) {
    const int64_t hk = h / R, qk_row = 2 * dk + 1, state = dk * dv;
    int64_t written = 0; /* chunks whose end state is stored */
    for (int64_t j = 0; j < n; j++) {
        const int64_t t = t0 + j;
        const float *qn = qkn + (t * Hk + hk) * qk_row, *kn = qn + dk;
        gdn_token(S, dv, qn, kn, kn[dk], v + (t * Hv + h) * dv + c0, expf(g[t * Hv + h]),
                  beta[t * Hv + h], o + (t * Hv + h) * dv + c0, dk, nc);
        if (cstates && ((offset + j + 1) % chunk == 0 || j == n - 1)) {
            float *dst = cstates + (written * Hv + h) * state + c0;
            for (int64_t i = 0; i < dk; i++) memcpy(dst + i * dv, S + i * dv, nc * sizeof(float));
            written++;
        }
    }
    for (; cstates && written < num_chunks_out; written++) {
        float *dst = cstates + (written * Hv + h) * state + c0;
        for (int64_t i = 0; i < dk; i++) memcpy(dst + i * dv, S + i * dv, nc * sizeof(float));
    }
}

/* The gated delta rule for packed sequences on pool slots (decode: one token per sequence).
 * q, k (T, Hk, dk); v, o (T, Hv, dv); g, beta (T, Hv): float32, contiguous. pool (num_slots,
 * Hv, dk, dv) float32; sequence s is tokens cu[s]..cu[s+1] and starts from (and leaves its
 * final state in) pool[slots[s]]. chunk_states (S, num_chunks_out, Hv, dk, dv) or NULL (then
 * start_pos and chunk are unused). qkn: scratch (T, Hk, 2 dk + 1). */
int64_t baton_gdn_scan(const float *q, const float *k, const float *v, const float *g,
                       const float *beta, float *pool, int64_t num_slots, const int64_t *slots,
                       const int64_t *cu, const int64_t *start_pos, int64_t num_seqs,
                       int64_t chunk, float *chunk_states, int64_t num_chunks_out,
                       int skip_padding, float *qkn, float *o, int64_t Hk, int64_t Hv,
                       int64_t dk, int64_t dv, int nthreads) {
    for (int64_t s = 0; s < num_seqs; s++)
        if (slots[s] < 0 || slots[s] >= num_slots) return s + 1;
    const int64_t T = cu[num_seqs], R = Hv / Hk, blocks = (dv + BV - 1) / BV;
    const int64_t tasks = num_seqs * Hv * blocks;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t th = 0; th < T * Hk; th++) {
            float *row = qkn + th * (2 * dk + 1);
            row[2 * dk] = normalise_qk(q + th * dk, k + th * dk, row, row + dk, dk);
        }
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t s = task / (Hv * blocks), h = (task / blocks) % Hv;
            const int64_t c0 = (task % blocks) * BV, nc = dv - c0 < BV ? dv - c0 : BV;
            const int64_t t0 = cu[s], n = cu[s + 1] - t0;
            if (skip_padding && slots[s] == 0) {
                for (int64_t t = t0; t < t0 + n; t++)
                    memset(o + (t * Hv + h) * dv + c0, 0, nc * sizeof(float));
                continue;
            }
            float *S = pool + (slots[s] * Hv + h) * dk * dv + c0;
            float *cs = chunk_states ? chunk_states + s * num_chunks_out * Hv * dk * dv : NULL;
            const int64_t offset = cs ? start_pos[s] % chunk : 0;
            if (nc == BV)
                scan_block(qkn, v, g, beta, S, o, cs, t0, n, offset, chunk, num_chunks_out, h, R,
                           Hk, Hv, dk, dv, c0, BV);
            else
                scan_block(qkn, v, g, beta, S, o, cs, t0, n, offset, chunk, num_chunks_out, h, R,
                           Hk, Hv, dk, dv, c0, nc);
        }
    }
    return 0;
}

/* One row of the decode conv: x = silu(conv(window | input)) over conv_dim channels, rounded to
 * the model dtype after the conv and after the SiLU (as transformers' bf16 conv then SiLU), the
 * window (pool row at `base`, (conv_dim, K-1)) shifted in place to take the input. */
static inline __attribute__((always_inline)) void conv_silu_row(const void *qkv, int64_t in,
                                                                void *conv_pool, int64_t base,
                                                                const float *conv_w, float *x,
                                                                int64_t conv_dim, const int64_t K,
                                                                const int bf16) {
    const int64_t km1 = K - 1;
#pragma omp simd
    for (int64_t c = 0; c < conv_dim; c++) {
        const int64_t at = base + c * km1;
        const float *w = conv_w + c * K;
        const float xin = load_any(qkv, bf16, in + c);
        float acc = xin * w[km1];
        for (int64_t j = 0; j < km1; j++) {
            const float held = load_any(conv_pool, bf16, at + j);
            acc += held * w[j];
            if (j) store_any(conv_pool, bf16, at + j - 1, held);
        }
        if (km1) store_any(conv_pool, bf16, at + km1 - 1, xin);
        x[c] = round_to(bf16, silu(round_to(bf16, acc)));
    }
}

/* One fused gated DeltaNet decode step, from the projections to the out_proj input:
 *   qkv = silu(conv(window[slot] | qkv_in))    (window shifted in place; rounded like torch)
 *   g = A softplus(a + dt_bias);  beta = sigmoid(b) * beta_scale   (beta rounded to the dtype)
 *   o = the gated delta rule step on state[slot]  (q, k l2-normalised; k heads repeated)
 *   out = (w * rmsnorm(o)) * silu(z)          per v head (transformers' norm-before-gate)
 * qkv (batch, conv_dim = 2 Hk dk + Hv dv) [q | k | v], z (batch, Hv dv), a and b (batch, Hv):
 * model-dtype rows with their own row strides (views into the projections). Conv pool
 * (num_slots, conv_dim, K-1) in the model dtype; state pool float32; conv_w (conv_dim, K),
 * A (= -exp(A_log)), dt_bias (Hv) and norm_w (dv) float32. xconv (batch, conv_dim), qkn
 * (batch, Hk, 2 dk + 1), o (batch, Hv dv): float32 scratch; out (batch, Hv dv) model dtype.
 * Rows with slot 0 are padding: both pools untouched, out = 0. */
int64_t baton_gdn_decode(const void *qkv, int64_t qkv_stride, const void *z, int64_t z_stride,
                         const void *a, const void *b, int64_t ab_stride, void *conv_pool,
                         float *state_pool, int64_t num_slots, const int64_t *slots,
                         int64_t batch, const float *conv_w, int64_t K, const float *A,
                         const float *dt_bias, float beta_scale, const float *norm_w, float eps,
                         float *xconv, float *qkn, float *o, void *out, int bf16, int64_t Hk,
                         int64_t Hv, int64_t dk, int64_t dv, int nthreads) {
    for (int64_t r = 0; r < batch; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return r + 1;
    const int64_t conv_dim = 2 * Hk * dk + Hv * dv, km1 = K - 1, R = Hv / Hk;
#pragma omp parallel num_threads(nthreads)
    {
        /* 1. conv + SiLU with the window shift; then q and k normalised per key head. */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < batch; r++) {
            if (slots[r] == 0) continue;
            float *x = xconv + r * conv_dim;
            const int64_t base = slots[r] * conv_dim * km1, in = r * qkv_stride;
            /* literal dtype and (usual) width per copy: the channel loop vectorises */
            if (bf16 && K == 4)
                conv_silu_row(qkv, in, conv_pool, base, conv_w, x, conv_dim, 4, 1);
            else if (bf16)
                conv_silu_row(qkv, in, conv_pool, base, conv_w, x, conv_dim, K, 1);
            else if (K == 4)
                conv_silu_row(qkv, in, conv_pool, base, conv_w, x, conv_dim, 4, 0);
            else
                conv_silu_row(qkv, in, conv_pool, base, conv_w, x, conv_dim, K, 0);
            for (int64_t hk = 0; hk < Hk; hk++) {
                float *row = qkn + (r * Hk + hk) * (2 * dk + 1);
                row[2 * dk] = normalise_qk(x + hk * dk, x + Hk * dk + hk * dk, row, row + dk, dk);
            }
        }
        /* 2. gating and the state update per (row, v head), the whole state at once. */
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < batch; r++) {
            for (int64_t h = 0; h < Hv; h++) {
                float *oh = o + (r * Hv + h) * dv;
                if (slots[r] == 0) continue;
                float sp = load_any(a, bf16, r * ab_stride + h) + dt_bias[h];
                sp = sp > 20.0f ? sp : log1pf(expf(sp)); /* softplus, torch's threshold */
                const float e = expf(A[h] * sp);
                const float bv = load_any(b, bf16, r * ab_stride + h);
                const float beta = round_to(bf16, round_to(bf16, 1.0f / (1.0f + expf(-bv))) * beta_scale);
                const float *qn = qkn + (r * Hk + h / R) * (2 * dk + 1), *kn = qn + dk;
                const float *v = xconv + r * conv_dim + 2 * Hk * dk + h * dv;
                float *S = state_pool + (slots[r] * Hv + h) * dk * dv;
                for (int64_t c0 = 0; c0 < dv; c0 += BV) {
                    if (dv - c0 >= BV)
                        gdn_token(S + c0, dv, qn, kn, kn[dk], v + c0, e, beta, oh + c0, dk, BV);
                    else
                        gdn_token(S + c0, dv, qn, kn, kn[dk], v + c0, e, beta, oh + c0, dk, dv - c0);
                }
            }
        }
        /* 3. per v head: out = (w * rmsnorm(o)) * silu(z), rounded where the torch path rounds:
         * o to the dtype (the rule's output), the normalised o, w times it, the result. */
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < batch; r++) {
            for (int64_t h = 0; h < Hv; h++) {
                const int64_t at = (r * Hv + h) * dv;
                if (slots[r] == 0) {
                    for (int64_t c = 0; c < dv; c++) store_any(out, bf16, at + c, 0.0f);
                    continue;
                }
                float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
                for (int64_t c = 0; c < dv; c++) {
                    o[at + c] = round_to(bf16, o[at + c]);
                    ss += o[at + c] * o[at + c];
                }
                const float inv = 1.0f / sqrtf(ss / (float)dv + eps);
#pragma omp simd
                for (int64_t c = 0; c < dv; c++) {
                    const float normed = round_to(bf16, round_to(bf16, o[at + c] * inv) * norm_w[c]);
                    const float gate = silu(load_any(z, bf16, r * z_stride + h * dv + c));
                    store_any(out, bf16, at + c, normed * gate);
                }
            }
        }
    }
    return 0;
}
