#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>
#include <string.h>

static inline void head_a(float *state, const float *xv, float dt, float decay, const float *Bv,
                          const float *Cv, float Dh, float *yv, int64_t P, int64_t N) {
    for (int64_t p = 0; p < P; p++) {
        const float xdt = xv[p] * dt;
        float *row = state + p * N;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t n = 0; n < N; n++) {
            const float s = row[n] * decay + xdt * Bv[n];
            row[n] = s;
            acc += s * Cv[n];
        }
        yv[p] = acc + Dh * xv[p];
    }
}

/* 4 rows at a time, 4 independent accumulators; N % 16 == 0 */
static inline void head_b(float *state, const float *xv, float dt, float decay, const float *Bv,
                          const float *Cv, float Dh, float *yv, int64_t P, int64_t N, int pf) {
    const __m512 vd = _mm512_set1_ps(decay);
    int64_t p = 0;
    for (; p + 4 <= P; p += 4) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const __m512 x0 = _mm512_set1_ps(xv[p] * dt), x1 = _mm512_set1_ps(xv[p + 1] * dt);
        const __m512 x2 = _mm512_set1_ps(xv[p + 2] * dt), x3 = _mm512_set1_ps(xv[p + 3] * dt);
        float *r0 = state + p * N, *r1 = r0 + N, *r2 = r1 + N, *r3 = r2 + N;
        for (int64_t n = 0; n < N; n += 16) {
            if (pf) {
                _mm_prefetch((const char *)(r0 + n + pf), _MM_HINT_T0);
                _mm_prefetch((const char *)(r2 + n + pf), _MM_HINT_T0);
            }
            const __m512 b = _mm512_loadu_ps(Bv + n), c = _mm512_loadu_ps(Cv + n);
            __m512 s0 = _mm512_fmadd_ps(_mm512_loadu_ps(r0 + n), vd, _mm512_mul_ps(x0, b));
            __m512 s1 = _mm512_fmadd_ps(_mm512_loadu_ps(r1 + n), vd, _mm512_mul_ps(x1, b));
            __m512 s2 = _mm512_fmadd_ps(_mm512_loadu_ps(r2 + n), vd, _mm512_mul_ps(x2, b));
            __m512 s3 = _mm512_fmadd_ps(_mm512_loadu_ps(r3 + n), vd, _mm512_mul_ps(x3, b));
            _mm512_storeu_ps(r0 + n, s0); _mm512_storeu_ps(r1 + n, s1);
            _mm512_storeu_ps(r2 + n, s2); _mm512_storeu_ps(r3 + n, s3);
            a0 = _mm512_fmadd_ps(s0, c, a0); a1 = _mm512_fmadd_ps(s1, c, a1);
            a2 = _mm512_fmadd_ps(s2, c, a2); a3 = _mm512_fmadd_ps(s3, c, a3);
        }
        yv[p] = _mm512_reduce_add_ps(a0) + Dh * xv[p];
        yv[p + 1] = _mm512_reduce_add_ps(a1) + Dh * xv[p + 1];
        yv[p + 2] = _mm512_reduce_add_ps(a2) + Dh * xv[p + 2];
        yv[p + 3] = _mm512_reduce_add_ps(a3) + Dh * xv[p + 3];
    }
}

int main(int argc, char **argv) {
    const int64_t S = 32, H = 24, P = 64, N = 128, L = 8;
    const int64_t per = S * H * P * N;
    float *pool = aligned_alloc(64, sizeof(float) * per * L);
    for (int64_t i = 0; i < per * L; i++) pool[i] = (i % 97) * 1e-3f;
    float *x = malloc(sizeof(float) * S * H * P), *y = malloc(sizeof(float) * S * H * P);
    float *B = malloc(sizeof(float) * S * N), *C = malloc(sizeof(float) * S * N);
    for (int i = 0; i < S * H * P; i++) x[i] = 0.01f * (i % 13);
    for (int i = 0; i < S * N; i++) { B[i] = 0.02f * (i % 7); C[i] = 0.03f * (i % 5); }
    for (int variant = 0; variant < 4; variant++) {
        int pf = variant == 2 ? 256 : (variant == 3 ? 512 : 0);
        double best = 1e9;
        for (int rep = 0; rep < 6; rep++) {
            double t = omp_get_wtime();
            for (int64_t l = 0; l < L; l++) {
                float *pl = pool + l * per;
#pragma omp parallel for collapse(2) schedule(static) num_threads(2)
                for (int64_t b = 0; b < S; b++)
                    for (int64_t h = 0; h < H; h++) {
                        float *st = pl + (b * H + h) * P * N;
                        if (variant == 0)
                            head_a(st, x + (b * H + h) * P, 0.1f, 0.99f, B + b * N, C + b * N, 1.0f, y + (b * H + h) * P, P, N);
                        else
                            head_b(st, x + (b * H + h) * P, 0.1f, 0.99f, B + b * N, C + b * N, 1.0f, y + (b * H + h) * P, P, N, pf);
                    }
            }
            t = omp_get_wtime() - t;
            if (t < best) best = t;
        }
        printf("variant %d: %.3f ms per layer, %.1f GB/s\n", variant, best / L * 1e3, 2.0 * per * 4 * L / best / 1e9);
    }
    return 0;
}
