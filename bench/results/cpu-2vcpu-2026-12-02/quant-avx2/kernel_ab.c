/* baton_qgemm of several builds of kernels/cpu_quant.c, alternated in one process, best of 15:
 * GB/s of weight bytes (codes + scales) at rows 1, 2, 3, 8, 32, for a 256 x 1024 weight (stays
 * in L2) and twelve 4096 x 4096 ones (streamed from memory).
 *   gcc -O3 -march=native -fopenmp -std=c11 -shared -fPIC kernels/cpu_quant.c -o lib_a.so
 *   gcc -O2 kernel_ab.c -o ab -ldl && ./ab THREADS ./lib_a.so ./lib_b.so ... */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef int (*qgemm_fn)(int, const float *, int64_t, int64_t, int64_t, const uint8_t *, const void *, int64_t,
                        const float *, int64_t, const float *, int, float *, int64_t, int);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char **argv) {
    const int threads = atoi(argv[1]);
    const int nlib = argc - 2;
    qgemm_fn fns[8];
    for (int i = 0; i < nlib; i++) { void *h = dlopen(argv[2 + i], RTLD_NOW | RTLD_LOCAL); if (!h) { printf("%s\n", dlerror()); return 1; } fns[i] = (qgemm_fn)dlsym(h, "baton_qgemm"); }
    const int64_t cases[][4] = {{256, 1024, 1, 200}, {4096, 4096, 12, 1}}; /* n, k, copies, reps */
    const int rows_list[] = {1, 2, 3, 8, 32};
    for (int fmt = 0; fmt < 2; fmt++)
        for (int ci = 0; ci < 2; ci++) {
            const int64_t n = cases[ci][0], k = cases[ci][1], copies = cases[ci][2], reps = cases[ci][3];
            const int64_t cb = fmt ? n * k / 2 : n * k, sb = fmt ? n * k / 16 : n * 4;
            uint8_t *codes = aligned_alloc(64, cb * copies), *scales = aligned_alloc(64, sb * copies);
            for (int64_t i = 0; i < cb * copies; i++) { uint8_t c = rand(); codes[i] = (c & 0x7f) == 0x7f ? 0 : c; }
            for (int64_t i = 0; i < sb * copies; i++) scales[i] = fmt ? 0x30 + rand() % 32 : 0;
            if (!fmt) for (int64_t i = 0; i < n * copies; i++) ((float *)scales)[i] = 1e34f;
            float *col = malloc(n * 4), *x = malloc(32 * k * 4), *y = malloc(32 * n * 4);
            for (int i = 0; i < n; i++) col[i] = 0.01f;
            for (int i = 0; i < 32 * k; i++) x[i] = (rand() % 1000) / 500.f - 1;
            for (int ri = 0; ri < 5; ri++) {
                const int rows = rows_list[ri];
                double best[8];
                for (int i = 0; i < nlib; i++) best[i] = 1e9;
                for (int trial = 0; trial < 15; trial++)
                    for (int i = 0; i < nlib; i++) {
                        const double t0 = now();
                        for (int r = 0; r < reps; r++)
                            for (int c = 0; c < copies; c++)
                                fns[i](fmt, x, rows, k, k, codes + c * cb, scales + c * sb, k, fmt ? col : NULL, n, NULL, 0, y, n, threads);
                        const double t = (now() - t0) / reps / copies;
                        if (t < best[i]) best[i] = t;
                    }
                printf("%s %s rows %2d GB/s:", fmt ? "nvfp4" : "fp8  ", ci ? "DRAM" : "L2  ", rows);
                for (int i = 0; i < nlib; i++) printf("  %6.2f", (cb + sb) / best[i] / 1e9);
                printf("\n");
            }
            free(codes); free(scales); free(col); free(x); free(y);
        }
    return 0;
}
