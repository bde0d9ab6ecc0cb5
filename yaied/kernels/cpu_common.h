/* Helpers shared by the CPU kernels (cpu_paged_decode.c, cpu_paged_prefill.c, cpu_fused.c):
 * bf16 conversion, a vectorisable exp, and per-thread scratch buffers. Header-only: each kernel file is built on
 * its own by yaied/kernels/cpu_build.py. */
#ifndef YAIED_CPU_COMMON_H
#define YAIED_CPU_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The ISA level this library was built for: the index in yaied/kernels/cpu_isa.py's LEVELS,
 * passed by cpu_build.py as -DYAIED_ISA_LEVEL. Each kernel file is its own library, so each
 * gets its own copy of this function. */
#ifndef YAIED_ISA_LEVEL
#define YAIED_ISA_LEVEL 0
#endif
int yaied_isa_level(void) { return YAIED_ISA_LEVEL; }

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

/* exp(x) for x <= 0 by 2^(x log2 e) = 2^n * 2^f with a degree-6 polynomial for 2^f (relative
 * error about 2e-7): unlike libm's expf it vectorises. */
/* 2^f for f in [0, 1]: a degree-6 polynomial, Horner's scheme. A macro, so that the same
 * operations serve a float or a GCC vector of floats (cpu_paged_decode.c). */
#define EXP2_FRACTION(f)                                                                           \
    (1.0f + (f) * (6.9314718e-1f + (f) * (2.4022652e-1f + (f) * (5.5503406e-2f +                   \
     (f) * (9.6180399e-3f + (f) * (1.3398874e-3f + (f) * 1.5353362e-4f))))))

static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    float n = __builtin_floorf(t);
    float f = t - n;
    float p = EXP2_FRACTION(f);
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* A per-thread buffer that only grows: the kernels run on the engine's worker thread and the
 * OpenMP pool's threads, which live as long as the process, so a step allocates nothing. */
#define SCRATCH_SLOTS 8
static inline void *thread_scratch(int slot, size_t bytes) {
    static __thread void *buffers[SCRATCH_SLOTS];
    static __thread size_t capacity[SCRATCH_SLOTS];
    if (capacity[slot] < bytes) {
        free(buffers[slot]);
        size_t rounded = (bytes + 63) / 64 * 64;
        buffers[slot] = aligned_alloc(64, rounded);
        capacity[slot] = buffers[slot] ? rounded : 0;
    }
    return buffers[slot];
}

#endif
