/* Read bandwidth: an AVX2 sum over 1 GiB of floats on THREADS threads, best of 10.
 *   gcc -O3 -march=native -fopenmp read_bandwidth.c -o rb && ./rb THREADS */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char **argv) {
    const int threads = atoi(argv[1]);
    const size_t n = (size_t)1 << 28; /* floats: 1 GiB */
    float *a = aligned_alloc(64, n * 4);
#pragma omp parallel for num_threads(threads)
    for (size_t i = 0; i < n; i++) a[i] = 1.0f;
    double best = 1e9; float total = 0;
    for (int t = 0; t < 10; t++) {
        const double t0 = now();
        float s = 0;
#pragma omp parallel num_threads(threads) reduction(+ : s)
        {
            __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
#pragma omp for
            for (size_t i = 0; i < n; i += 32)
                for (int v = 0; v < 4; v++) acc[v] = _mm256_add_ps(acc[v], _mm256_load_ps(a + i + 8 * v));
            float out[8]; _mm256_storeu_ps(out, _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
            for (int v = 0; v < 8; v++) s += out[v];
        }
        total += s;
        const double dt = now() - t0; if (dt < best) best = dt;
    }
    printf("threads %d: read %.1f GB/s (%g)\n", threads, n * 4 / best / 1e9, total);
    return 0;
}
