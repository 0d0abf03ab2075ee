/* Kimi Delta Attention on the CPU for baton (built at first use by kernels/cpu/kda.py).
 *
 * The recurrence of kernels/kda.py, token by token, on the state in its pool slot (per head, S of
 * dk rows x dv columns, e = exp(g) one decay per ROW, i.e. per key channel):
 *   S <- diag(e) S;  delta = beta (v - k^T S);  S <- S + k delta^T;  o = q^T S
 * rewritten, as the gated delta rule's kernel (gated_delta.c) does, so that each token reads the
 * state twice and writes it once; the per-row decay moves into the vectors that read it:
 *   pass 1:  kv = (k o e)^T S,  qs = (q o e)^T S               (S as it stood, before the decay)
 *            delta = beta (v - kv),  o = qs + (q . k) delta
 *   pass 2:  S_i <- e_i S_i + k_i delta                          (row i)
 * The columns of a head's state evolve independently, so a task is one (sequence, head, block of
 * BV columns) whose dk x BV block stays in L1 across the sequence's tokens; tasks need no
 * synchronisation. Per (token, head) the first parallel pass prepares [q o e | k o e | k | e | q.k]
 * (q, k l2-normalised, q scaled by dk^-1/2) once for every column block.
 *
 * Prefill also copies the block into chunk_states at every end of an aligned chunk (the chunk
 * grid of kernels/ssd.py) and at the sequence's last token; chunks past the sequence's end repeat
 * its final state. Rows whose slot is 0 are decode padding when skip_padding is set: no read, no
 * write, o = 0. Slots are checked before anything is written: the first bad row + 1 is returned,
 * else 0.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define BV 32 /* state columns per task */

/* The prepared vectors of one (token, head): [qe | ke | kn | e | qk], 4 dk + 1 floats. */
#define PREP(dk) (4 * (dk) + 1)

#if defined(__AVX512F__)
#include <immintrin.h>

/* kda_token on a full block of BV = 32 columns: two vectors per state row, the pass-1 sums in
 * eight registers (rows two at a time), explicit FMAs. */
static inline __attribute__((always_inline)) void kda_token_full(float *S, int64_t ld,
                                                                 const float *prep, const float *v,
                                                                 float beta, float *o, int64_t dk) {
    const float *qe = prep, *ke = prep + dk, *kn = prep + 2 * dk, *e = prep + 3 * dk;
    __m512 kv[4], qs[4];
    for (int j = 0; j < 4; j++) kv[j] = qs[j] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 2 <= dk; i += 2) {
        for (int r = 0; r < 2; r++) {
            const float *row = S + (i + r) * ld;
            const __m512 r0 = _mm512_loadu_ps(row), r1 = _mm512_loadu_ps(row + 16);
            const __m512 ki = _mm512_set1_ps(ke[i + r]), qi = _mm512_set1_ps(qe[i + r]);
            kv[2 * r] = _mm512_fmadd_ps(ki, r0, kv[2 * r]);
            kv[2 * r + 1] = _mm512_fmadd_ps(ki, r1, kv[2 * r + 1]);
            qs[2 * r] = _mm512_fmadd_ps(qi, r0, qs[2 * r]);
            qs[2 * r + 1] = _mm512_fmadd_ps(qi, r1, qs[2 * r + 1]);
        }
    }
    if (i < dk) {
        const float *row = S + i * ld;
        const __m512 r0 = _mm512_loadu_ps(row), r1 = _mm512_loadu_ps(row + 16);
        const __m512 ki = _mm512_set1_ps(ke[i]), qi = _mm512_set1_ps(qe[i]);
        kv[0] = _mm512_fmadd_ps(ki, r0, kv[0]);
        kv[1] = _mm512_fmadd_ps(ki, r1, kv[1]);
        qs[0] = _mm512_fmadd_ps(qi, r0, qs[0]);
        qs[1] = _mm512_fmadd_ps(qi, r1, qs[1]);
    }
    const __m512 bv = _mm512_set1_ps(beta), qkv = _mm512_set1_ps(prep[4 * dk]);
    __m512 delta[2];
    for (int h = 0; h < 2; h++) {
        const __m512 kvh = _mm512_add_ps(kv[h], kv[h + 2]), qsh = _mm512_add_ps(qs[h], qs[h + 2]);
        delta[h] = _mm512_mul_ps(bv, _mm512_sub_ps(_mm512_loadu_ps(v + 16 * h), kvh));
        _mm512_storeu_ps(o + 16 * h, _mm512_fmadd_ps(qkv, delta[h], qsh));
    }
    for (i = 0; i < dk; i++) {
        float *row = S + i * ld;
        const __m512 ki = _mm512_set1_ps(kn[i]), ei = _mm512_set1_ps(e[i]);
        _mm512_storeu_ps(row, _mm512_fmadd_ps(ki, delta[0], _mm512_mul_ps(ei, _mm512_loadu_ps(row))));
        _mm512_storeu_ps(row + 16,
                         _mm512_fmadd_ps(ki, delta[1], _mm512_mul_ps(ei, _mm512_loadu_ps(row + 16))));
    }
}
#endif

/* One token on an nc-column block of one head's state S (rows dk, row stride ld); prep the
 * token's [qe | ke | kn | e | qk]; v, o the block's nc columns. */
static inline __attribute__((always_inline)) void kda_token(float *S, int64_t ld,
                                                            const float *prep, const float *v,
                                                            float beta, float *o, int64_t dk,
                                                            const int64_t nc) {
#if defined(__AVX512F__)
    if (nc == BV) {
        kda_token_full(S, ld, prep, v, beta, o, dk);
        return;
    }
#endif
    const float *qe = prep, *ke = prep + dk, *kn = prep + 2 * dk, *e = prep + 3 * dk;
    const float qk = prep[4 * dk];
    float kv[BV], qs[BV], delta[BV];
#pragma omp simd
    for (int64_t c = 0; c < nc; c++) kv[c] = qs[c] = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        const float *row = S + i * ld;
        const float ki = ke[i], qi = qe[i];
#pragma omp simd
        for (int64_t c = 0; c < nc; c++) {
            kv[c] += ki * row[c];
            qs[c] += qi * row[c];
        }
    }
#pragma omp simd
    for (int64_t c = 0; c < nc; c++) {
        delta[c] = beta * (v[c] - kv[c]);
        o[c] = qs[c] + qk * delta[c];
    }
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * ld;
        const float ki = kn[i], ei = e[i];
#pragma omp simd
        for (int64_t c = 0; c < nc; c++) row[c] = ei * row[c] + ki * delta[c];
    }
}

/* Prepare one (token, head): q, k l2-normalised (x / sqrt(sum x^2 + 1e-6), transformers' form),
 * q scaled by dk^-1/2, e = exp(g), into prep = [q o e | k o e | k | e | q . k]. */
static inline void prepare(const float *q, const float *k, const float *g, float *prep,
                           int64_t dk) {
    float sq = 0.0f, sk = 0.0f;
#pragma omp simd reduction(+ : sq, sk)
    for (int64_t i = 0; i < dk; i++) {
        sq += q[i] * q[i];
        sk += k[i] * k[i];
    }
    const float nq = sqrtf(sq + 1e-6f), nk = sqrtf(sk + 1e-6f), scale = 1.0f / sqrtf((float)dk);
    float qk = 0.0f;
    for (int64_t i = 0; i < dk; i++) {
        const float qi = q[i] / nq * scale, ki = k[i] / nk, ei = expf(g[i]);
        prep[i] = qi * ei;
        prep[dk + i] = ki * ei;
        prep[2 * dk + i] = ki;
        prep[3 * dk + i] = ei;
        qk += qi * ki;
    }
    prep[4 * dk] = qk;
}

static inline void copy_block(float *dst, const float *S, int64_t dk, int64_t dv, int64_t nc) {
    for (int64_t i = 0; i < dk; i++) memcpy(dst + i * dv, S + i * dv, nc * sizeof(float));
}

/* One (sequence, head, column block) task of baton_kda_scan. */
static inline __attribute__((always_inline)) void scan_block(
    const float *prep, const float *v, const float *beta, float *S, float *o, float *cstates,
    int64_t t0, int64_t n, int64_t offset, int64_t chunk, int64_t num_chunks_out, int64_t h,
    int64_t H, int64_t dk, int64_t dv, int64_t c0, const int64_t nc) {
    const int64_t state = dk * dv;
    int64_t written = 0; /* chunks whose end state is stored */
    for (int64_t j = 0; j < n; j++) {
        const int64_t t = t0 + j, th = t * H + h;
        kda_token(S, dv, prep + th * PREP(dk), v + th * dv + c0, beta[th], o + th * dv + c0, dk,
                  nc);
        if (cstates && ((offset + j + 1) % chunk == 0 || j == n - 1)) {
            copy_block(cstates + (written * H + h) * state + c0, S, dk, dv, nc);
            written++;
        }
    }
    for (; cstates && written < num_chunks_out; written++)
        copy_block(cstates + (written * H + h) * state + c0, S, dk, dv, nc);
}

/* KDA for packed sequences on pool slots (decode: one token per sequence).
 * q, k, g (T, H, dk); v, o (T, H, dv); beta (T, H): float32, contiguous (g the log decay).
 * pool (num_slots, H, dk, dv) float32; sequence s is tokens cu[s]..cu[s+1] and starts from (and
 * leaves its final state in) pool[slots[s]]. chunk_states (S, num_chunks_out, H, dk, dv) or NULL
 * (then start_pos and chunk are unused). prep: scratch (T, H, 4 dk + 1). */
int64_t baton_kda_scan(const float *q, const float *k, const float *v, const float *g,
                       const float *beta, float *pool, int64_t num_slots, const int64_t *slots,
                       const int64_t *cu, const int64_t *start_pos, int64_t num_seqs,
                       int64_t chunk, float *chunk_states, int64_t num_chunks_out,
                       int skip_padding, float *prep, float *o, int64_t H, int64_t dk, int64_t dv,
                       int nthreads) {
    for (int64_t s = 0; s < num_seqs; s++)
        if (slots[s] < 0 || slots[s] >= num_slots) return s + 1;
    const int64_t T = cu[num_seqs], blocks = (dv + BV - 1) / BV;
    const int64_t tasks = num_seqs * H * blocks;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t th = 0; th < T * H; th++)
            prepare(q + th * dk, k + th * dk, g + th * dk, prep + th * PREP(dk), dk);
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t s = task / (H * blocks), h = (task / blocks) % H;
            const int64_t c0 = (task % blocks) * BV, nc = dv - c0 < BV ? dv - c0 : BV;
            const int64_t t0 = cu[s], n = cu[s + 1] - t0;
            if (skip_padding && slots[s] == 0) {
                for (int64_t t = t0; t < t0 + n; t++)
                    memset(o + (t * H + h) * dv + c0, 0, nc * sizeof(float));
                continue;
            }
            float *S = pool + (slots[s] * H + h) * dk * dv + c0;
            float *cs = chunk_states ? chunk_states + s * num_chunks_out * H * dk * dv : NULL;
            const int64_t offset = cs ? start_pos[s] % chunk : 0;
            if (nc == BV)
                scan_block(prep, v, beta, S, o, cs, t0, n, offset, chunk, num_chunks_out, h, H, dk,
                           dv, c0, BV);
            else
                scan_block(prep, v, beta, S, o, cs, t0, n, offset, chunk, num_chunks_out, h, H, dk,
                           dv, c0, nc);
        }
    }
    return 0;
}

/* One row of the decode conv: x = silu(conv(window | input)) over conv_dim channels, rounded to
 * the model dtype after the conv and after the SiLU (as transformers' conv then SiLU), the window
 * (pool row at `base`, (conv_dim, K-1)) shifted in place to take the input. */
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

/* One fused KDA decode step, from the projections to the o_proj input:
 *   qkv = silu(conv(window[slot] | qkv_in))     (window shifted in place; rounded like torch)
 *   g = A softplus(f + dt_bias) per key channel, or with `safe` (Bailing's bounded gate)
 *   g = lb sigmoid(-A (f + dt_bias)) rounded to the dtype;  beta = sigmoid(b)  (rounded too)
 *   o = the KDA step on state[slot]             (q, k l2-normalised)
 *   out = w * rmsnorm(o) * sigmoid(gate)        per head, float32 from the dtype-rounded o
 * qkv (batch, 3 H d) [q | k | v], f and gate (batch, H d), b (batch, H): model-dtype rows with
 * their own row strides (views into the projections). Conv pool (num_slots, 3 H d, K-1) in the
 * model dtype; state pool float32; conv_w (3 H d, K), A (= -exp(A_log), H), dt_bias (H d) and
 * norm_w (d) float32. xconv (batch, 3 H d), prep (batch, H, 4 d + 1), o (batch, H d): float32
 * scratch; out (batch, H d) model dtype. Rows with slot 0 are padding: both pools untouched,
 * out = 0. */
int64_t baton_kda_decode(const void *qkv, int64_t qkv_stride, const void *f, int64_t f_stride,
                         const void *b, int64_t b_stride, const void *gate, int64_t gate_stride,
                         void *conv_pool, float *state_pool, int64_t num_slots,
                         const int64_t *slots, int64_t batch, const float *conv_w, int64_t K,
                         const float *A, const float *dt_bias, int safe, float lb,
                         const float *norm_w, float eps,
                         float *xconv, float *prep, float *o, void *out, int bf16, int64_t H,
                         int64_t d, int nthreads) {
    for (int64_t r = 0; r < batch; r++)
        if (slots[r] < 0 || slots[r] >= num_slots) return r + 1;
    const int64_t W = H * d, conv_dim = 3 * W, km1 = K - 1;
#pragma omp parallel num_threads(nthreads)
    {
        /* 1. conv + SiLU with the window shift */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < batch; r++) {
            if (slots[r] == 0) continue;
            float *x = xconv + r * conv_dim;
            const int64_t base = slots[r] * conv_dim * km1, in = r * qkv_stride;
            if (bf16 && K == 4)
                conv_silu_row(qkv, in, conv_pool, base, conv_w, x, conv_dim, 4, 1);
            else if (bf16)
                conv_silu_row(qkv, in, conv_pool, base, conv_w, x, conv_dim, K, 1);
            else if (K == 4)
                conv_silu_row(qkv, in, conv_pool, base, conv_w, x, conv_dim, 4, 0);
            else
                conv_silu_row(qkv, in, conv_pool, base, conv_w, x, conv_dim, K, 0);
        }
        /* 2. per (row, head): the decay, beta, and the state update, the whole state at once */
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < batch; r++) {
            for (int64_t h = 0; h < H; h++) {
                if (slots[r] == 0) continue;
                const float *x = xconv + r * conv_dim;
                float g[1024], *p = prep + (r * H + h) * PREP(d);
                for (int64_t i = 0; i < d; i++) {
                    float x = load_any(f, bf16, r * f_stride + h * d + i) + dt_bias[h * d + i];
                    if (safe) {
                        g[i] = round_to(bf16, lb / (1.0f + expf(A[h] * x)));
                    } else {
                        x = x > 20.0f ? x : log1pf(expf(x)); /* softplus, torch's threshold */
                        g[i] = A[h] * x;
                    }
                }
                prepare(x + h * d, x + W + h * d, g, p, d);
                const float beta = round_to(bf16, 1.0f / (1.0f + expf(-load_any(b, bf16, r * b_stride + h))));
                const float *v = x + 2 * W + h * d;
                float *S = state_pool + (slots[r] * H + h) * d * d, *oh = o + (r * H + h) * d;
                for (int64_t c0 = 0; c0 < d; c0 += BV) {
                    if (d - c0 >= BV)
                        kda_token(S + c0, d, p, v + c0, beta, oh + c0, d, BV);
                    else
                        kda_token(S + c0, d, p, v + c0, beta, oh + c0, d, d - c0);
                }
            }
        }
        /* 3. per head: out = w * rmsnorm(o) * sigmoid(gate) in float32 from o rounded to the
         * dtype (the rule's output), rounded once at the end (transformers' gated norm) */
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < batch; r++) {
            for (int64_t h = 0; h < H; h++) {
                const int64_t at = (r * H + h) * d;
                if (slots[r] == 0) {
                    for (int64_t c = 0; c < d; c++) store_any(out, bf16, at + c, 0.0f);
                    continue;
                }
                float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
                for (int64_t c = 0; c < d; c++) {
                    o[at + c] = round_to(bf16, o[at + c]);
                    ss += o[at + c] * o[at + c];
                }
                const float inv = 1.0f / sqrtf(ss / (float)d + eps);
                for (int64_t c = 0; c < d; c++) {
                    const float gv = load_any(gate, bf16, r * gate_stride + h * d + c);
                    const float sig = 1.0f / (1.0f + expf(-gv));
                    store_any(out, bf16, at + c, norm_w[c] * (o[at + c] * inv) * sig);
                }
            }
        }
    }
    return 0;
}
