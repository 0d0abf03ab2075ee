/* Fused CPU decode kernels for baton (built at first use by kernels/cpu_ops.py).
 *
 * The torch path of a decode step touches each pool slot several times: gather into a scratch
 * buffer, scale, add the outer product, scatter back, reduce against C. These loops read and
 * write every state element once, in place in the pool, with the rows of a batch split across
 * OpenMP threads (the same libgomp runtime torch uses).
 *
 * Layouts are the pools' and kernels/ssu.py's / kernels/conv1d.py's: contiguous, row-major.
 * Every function checks its slot indices and returns the first bad row + 1 (0 when all are in
 * range) before it writes anything, so a bad index is an error rather than a stray write.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static int64_t check_slots(const int64_t *slots, int64_t batch, int64_t num_slots) {
    for (int64_t b = 0; b < batch; b++)
        if (slots[b] < 0 || slots[b] >= num_slots) return b + 1;
    return 0;
}

static inline float bf16_to_f32(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, like torch */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* Selective state update, one token per row, float32 pool updated in place.
 *   state[s,h] <- state[s,h] * exp(dt[b,h] * A[h]) + (dt[b,h] * x[b,h]) (outer) B[b,g]
 *   y[b,h]      = state[s,h] . C[b,g] + D[h] * x[b,h]          (g = h / (H / G))
 * pool (num_slots, H, P, N); x, y (batch, H, P); dt (batch, H) already discretized;
 * A, D (H); B, C (batch, G, N). */
int64_t baton_ssu_f32(float *pool, int64_t num_slots, const int64_t *slots, int64_t batch,
                      const float *x, const float *dt, const float *A, const float *B,
                      const float *C, const float *D, float *y, int64_t H, int64_t P, int64_t N,
                      int64_t G, int nthreads) {
    int64_t bad = check_slots(slots, batch, num_slots);
    if (bad) return bad;
    const int64_t heads_per_group = H / G;
#pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t h = 0; h < H; h++) {
            const int64_t g = h / heads_per_group;
            const float dt_bh = dt[b * H + h];
            const float decay = expf(dt_bh * A[h]);
            const float *Bv = B + (b * G + g) * N;
            const float *Cv = C + (b * G + g) * N;
            const float *xv = x + (b * H + h) * P;
            float *yv = y + (b * H + h) * P;
            float *state = pool + (slots[b] * H + h) * P * N;
            for (int64_t p = 0; p < P; p++) {
                const float xdt = xv[p] * dt_bh;
                float *row = state + p * N;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t n = 0; n < N; n++) {
                    const float s = row[n] * decay + xdt * Bv[n];
                    row[n] = s;
                    acc += s * Cv[n];
                }
                yv[p] = acc + D[h] * xv[p];
            }
        }
    }
    return 0;
}

/* One causal-conv decode step on the conv pool (num_slots, dim, K-1), then SiLU.
 * x, out (batch, dim) float32; w (dim, K) float32; bias (dim) or NULL. The pool holds float32
 * (pool_bf16 = 0) or bfloat16 (pool_bf16 = 1); the window shifts left by one and takes x. */
#define CONV_UPDATE_LOOP(T, LOAD, STORE)                                                      \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")                        \
    for (int64_t b = 0; b < batch; b++) {                                                     \
        T *rows = (T *)pool + slots[b] * dim * km1;                                           \
        const float *xb = x + b * dim;                                                        \
        float *ob = out + b * dim;                                                            \
        _Pragma("omp simd")                                                                    \
        for (int64_t c = 0; c < dim; c++) {                                                   \
            T *win = rows + c * km1;                                                          \
            const float *wc = w + c * K;                                                      \
            float acc = bias ? bias[c] : 0.0f;                                                \
            float prev = LOAD(win[0]);                                                        \
            acc += prev * wc[0];                                                              \
            for (int64_t k = 1; k < km1; k++) {                                               \
                const float v = LOAD(win[k]);                                                 \
                acc += v * wc[k];                                                             \
                win[k - 1] = STORE(v);                                                        \
            }                                                                                 \
            acc += xb[c] * wc[km1];                                                           \
            win[km1 - 1] = STORE(xb[c]);                                                      \
            ob[c] = acc / (1.0f + expf(-acc));                                                \
        }                                                                                     \
    }

#define IDENTITY(v) (v)

int64_t baton_conv_update(void *pool, int pool_bf16, int64_t num_slots, const int64_t *slots,
                          int64_t batch, const float *x, const float *w, const float *bias,
                          float *out, int64_t dim, int64_t K, int nthreads) {
    int64_t bad = check_slots(slots, batch, num_slots);
    if (bad) return bad;
    const int64_t km1 = K - 1;
    if (pool_bf16) {
        CONV_UPDATE_LOOP(uint16_t, bf16_to_f32, f32_to_bf16)
    } else {
        CONV_UPDATE_LOOP(float, IDENTITY, IDENTITY)
    }
    return 0;
}

/* Row-wise argmax of a float32 (rows, cols) matrix with row stride `stride`; the first index of
 * the maximum wins, like torch.argmax. A row holding NaN gets `cols` (the caller resolves it).
 * Vectorised block maxima find the first block holding the row maximum; one short scalar scan
 * of that block finds the position. */
#define ARGMAX_BLOCK 256
void baton_argmax_f32(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out,
                      int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        float best = row[0];
        int64_t best_block = 0;
        int nan = 0;
        for (int64_t start = 0; start < cols; start += ARGMAX_BLOCK) {
            const int64_t end = start + ARGMAX_BLOCK < cols ? start + ARGMAX_BLOCK : cols;
            float m = row[start];
#pragma omp simd reduction(max : m) reduction(| : nan)
            for (int64_t c = start; c < end; c++) {
                m = row[c] > m ? row[c] : m;
                nan |= row[c] != row[c];
            }
            if (m > best) {
                best = m;
                best_block = start;
            }
        }
        int64_t at = best_block;
        while (row[at] != best) at++;
        out[r] = nan ? cols : at;
    }
}
