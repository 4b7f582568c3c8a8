// e4m3.cuh — two e4m3 weight codes (FP8, the "fn" variant of loader/quant.py) as the bf16 pair a bf16 tensor-core
// product reads, exactly (every e4m3 value is a bf16 value): the weight format WFMT = 1 of moe_gemm_tc.cu and
// moe_gemm_wg.cu.  CVT = 1 goes through the conversion unit (e4m3x2 -> f16x2 -> 2 x f32 -> bf16x2, sm_89+); CVT = 0
// moves each byte's sign and its 7 exponent and mantissa bits into bf16 places (the bf16 then holds the value times
// 2^-120; a subnormal code, exponent 0, lands on the bf16 subnormal of the same ratio) and multiplies the pair by
// 2^120 in bf16 (exact, -0 added so that the sign of zero stays).  H200 (ops/moe_gemm_tc.py E4M3_CONVERT): 1 is the
// faster in both kernels.  The two NaN codes (0x7F, 0xFF) are the one difference: NaN through the conversion unit,
// +-480 by the bit moves; loader/quant.quantize_rows never writes them (it refuses non-finite weights and clips).
#pragma once
#include "common.cuh"

// The e4m3 row rule of quant.cu and rmsnorm.cu E4M3_OUT (loader/quant.quantize_rows): a finite row's scale is
// amax / 448, or 1 with zero codes when amax < 448 * FLT_MIN (its scale would be subnormal); activations' codes are
// e4m3(x · r) with r = 1 / scale rounded once (reciprocal=True), clamped to +-448 and rounded to nearest even.
struct E4m3Row {
    float scale, r;  // r = 1 / scale
    bool zero;       // every code 0
};
__device__ __forceinline__ E4m3Row e4m3_row(float amax) {
    const float tiny = 448.f * 1.17549435e-38f;  // 448 * FLT_MIN, exact in fp32
    E4m3Row q;
    q.zero = !(amax >= tiny);
    q.scale = q.zero ? 1.f : __fdiv_rn(amax, 448.f);
    q.r = __frcp_rn(q.scale);
    return q;
}
// the codes of a and b (already over the scale), a at the lower byte
__device__ __forceinline__ unsigned short e4m3x2_codes(float a, float b) {
    unsigned short pair;
    const float qa = fminf(fmaxf(a, -448.f), 448.f), qb = fminf(fmaxf(b, -448.f), 448.f);
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(qb), "f"(qa));
    return pair;
}

// the codes in bits 0-7 (the first, to the low half) and 8-15 of `pair`
template <int CVT>
__device__ __forceinline__ unsigned e4m3x2_to_bf16x2(unsigned pair) {
    if constexpr (CVT) {
        unsigned h;
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"((unsigned short)pair));
        float lo, hi;
        asm("{.reg .b16 l, u;\n mov.b32 {l, u}, %2;\n cvt.f32.f16 %0, l;\n cvt.f32.f16 %1, u;}" : "=f"(lo), "=f"(hi)
            : "r"(h));
        __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<unsigned*>(&p);
    } else {
        const unsigned v = __byte_perm(pair, 0u, 0x1404);  // the codes at bits 8-15 and 24-31, zeros below them
        unsigned b = (v & 0x80008000u) | ((v >> 4) & 0x07F007F0u);
        const unsigned two120 = 0x7B807B80u, neg_zero = 0x80008000u;
        asm("fma.rn.bf16x2 %0, %0, %1, %2;" : "+r"(b) : "r"(two120), "r"(neg_zero));
        return b;
    }
}
