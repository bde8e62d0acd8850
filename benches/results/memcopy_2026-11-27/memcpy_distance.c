/* memcpy time by the destination's distance above the source, modulo 4 KiB, against a
 * backward copy in 2 KiB blocks (what src/memcopy.rs does at short distances).
 * gcc -O2 -o memcpy_distance memcpy_distance.c && ./memcpy_distance 65536 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
/* Called through a pointer, so the compiler cannot inline a block copy as `rep movsq`: the
 * backward blocks must go through glibc's memcpy, as Rust's copy_from_slice does. */
static void *(*volatile copy_fn)(void *, const void *, size_t) = memcpy;
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static void backward(char *d, const char *s, size_t n, size_t block) {
    size_t end = n;
    while (end > 0) { size_t k = end < block ? end : block; end -= k; copy_fn(d + end, s + end, k); }
}
int main(int argc, char **argv) {
    size_t n = argc > 1 ? (size_t)atol(argv[1]) : 65536;
    char *a = aligned_alloc(4096, n + 8192), *b = aligned_alloc(4096, n + 8192);
    memset(a, 1, n + 8192); memset(b, 2, n + 8192);
    int reps = n <= 4096 ? 4000 : n <= 65536 ? 400 : 100;
    int ds[] = {0, 8, 16, 24, 32, 40, 56, 64, 72, 120, 200, 520, 2048, 4088};
    printf("%zu bytes: distance: memcpy / backward 2 KiB blocks (best of 5, us)\n", n);
    for (int i = 0; i < (int)(sizeof ds / sizeof ds[0]); i++) {
        char *src = a + 16, *dst = b + 16 + ds[i];
        double tm = 1e9, tb = 1e9;
        for (int r = 0; r < 5; r++) {
            double t0 = now();
            for (int k = 0; k < reps; k++) { copy_fn(dst, src, n); __asm__ volatile("" ::"r"(dst) : "memory"); }
            double t = (now() - t0) / reps; if (t < tm) tm = t;
            t0 = now();
            for (int k = 0; k < reps; k++) { backward(dst, src, n, 2048); __asm__ volatile("" ::"r"(dst) : "memory"); }
            t = (now() - t0) / reps; if (t < tb) tb = t;
        }
        printf("  %4d: %7.2f / %7.2f\n", ds[i], tm * 1e6, tb * 1e6);
    }
    return 0;
}
