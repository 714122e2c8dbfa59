/* float16 -> float32, exactly (numpy's conversion: subnormals, Inf and NaN payloads kept); the one
 * definition both compiled modules include (lct/format/_native.c, kernels/_native.c). */
#ifndef LCT_F16_H
#define LCT_F16_H

#include <stdint.h>
#include <string.h>

static inline float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3FFu, u;
    if (e == 31)
        u = sign | 0x7F800000u | (m << 13);  /* Inf, NaN (payload kept, as numpy does) */
    else if (e)
        u = sign | ((e + 112) << 23) | (m << 13);
    else if (!m)
        u = sign;
    else {  /* subnormal m * 2^-24: normalise */
        e = 113;
        while (!(m & 0x400u)) {
            m <<= 1;
            e--;
        }
        u = sign | (e << 23) | ((m & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#endif
