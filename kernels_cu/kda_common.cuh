// kda_common.cuh — per-channel KDA math shared by kda_decode.cu and kda_prefill.cu (spec §3.2–3.5).
//
//   conv:  u = sum_j w[j] * x_{t-(W-1)+j}  (tap W-1 = current token),  y = bf16(SiLU(u))
//   gate:  g = -exp(A_log) * softplus(f + dt_bias),  softplus(z) = z for z > 20
//   beta:  sigmoid(b)
// Accurate expf / log1pf (no __expf): these feed the fp32 state, whose tolerance is 1e-4.  (kda_prefill.cu's
// intra kernel takes e^z inside the softplus and e^-u of the SiLU from ex2.approx instead, relative error
// ~2^-22 before log1pf and before the bf16 rounding; test_kda_prefill.py measures it against NumPy.)
#pragma once
#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// scalar math (round_bf16, sigmoid and silu come from common.cuh)

// log decay of one key channel (<= 0); may be hugely negative (-300 and below)
__device__ __forceinline__ float kda_log_decay(float f, float dt_bias, float a_log) {
    const float z = f + dt_bias;
    return -expf(a_log) * (z > 20.f ? z : log1pf(expf(z)));
}

// conv output of one channel, rounded to bf16 as the references store it.  `hist[j]` holds the
// raw inputs before the current token, oldest first: hist[0] = x_{t-(W-1)}, hist[W-2] = x_{t-1}.
template <int W>
__device__ __forceinline__ float kda_conv_silu(const float* __restrict__ taps, const float (&hist)[W - 1], float x) {
    float u = 0.f;
#pragma unroll
    for (int j = 0; j < W - 1; ++j) u = fmaf(taps[j], hist[j], u);
    u = fmaf(taps[W - 1], x, u);
    return round_bf16(silu(u));
}

// softplus(f + dt_bias): kda_log_decay without its -exp(A_log) factor, for callers that hoist that
// factor out of a loop (-exp(a_log) * kda_softplus(f, dt_bias) == kda_log_decay(f, dt_bias, a_log))
__device__ __forceinline__ float kda_softplus(float f, float dt_bias) {
    const float z = f + dt_bias;
    return z > 20.f ? z : log1pf(expf(z));
}
// the same with e^z from ex2.approx alone (kda_prefill.cu's intra kernel; relative error ~2^-22 before log1pf)
__device__ __forceinline__ float kda_softplus_approx(float f, float dt_bias) {
    const float z = f + dt_bias;
    return z > 20.f ? z : log1pf(exp2_approx(1.4426950408889634f * z));
}
// the same without log1pf and without a branch (log1pf's polynomial sits in divergent-branch regions in sm_90a SASS, so
// a loop over rows cannot interleave them): log1p(x), x = e^min(z, 20) from ex2.approx, by its series to x^9 / 9
// below x = 1/8 (truncation < x^10 / 10: relative < 1e-9; measured in fp32 with exact x: <= 9e-8), else
// ln 2 * lg2.approx(1 + x): the rounding of 1 + x costs <= 2^-24 in the log, <= 5.2e-7 relative from x = 1/8 up
// (measured), and the PTX ISA bounds lg2.approx.f32's absolute error by 2^-22.6: <= 9.3e-7 relative there.  So
// <= ~1.5e-6 relative given x; against softplus(z) the rounding of ex2's argument (~|z| 2^-24 relative, as in
// kda_softplus_approx) dominates.  NaN stays NaN, -inf gives 0 and +inf gives +inf, as kda_softplus_approx.
__device__ __forceinline__ float kda_softplus_fast(float f, float dt_bias) {
    const float z = f + dt_bias;
    const float x = exp2_approx(1.4426950408889634f * (z > 20.f ? 20.f : z));  // NaN in, NaN out
    float lg;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(lg) : "f"(1.f + x));
    float h = 1.f / 9.f;
    h = fmaf(x, h, -1.f / 8.f), h = fmaf(x, h, 1.f / 7.f), h = fmaf(x, h, -1.f / 6.f), h = fmaf(x, h, 1.f / 5.f);
    h = fmaf(x, h, -1.f / 4.f), h = fmaf(x, h, 1.f / 3.f), h = fmaf(x, h, -1.f / 2.f), h = fmaf(x, h, 1.f);
    const float lp = x < 0.125f ? x * h : 0.6931471805599453f * lg;
    return z > 20.f ? z : lp;
}
// the same with one exponential and no logarithm: max(z, 0) + log1p(y), y = e^-|z| in (0, 1] from ex2.approx, log1p(y)
// as y p(y), p a degree-7 least-squares fit of log1p(y) / y on Chebyshev nodes of [0, 1] (fp32 Horner: <= 3.4e-7
// relative to log1p(y), measured in float64 against fp32 coefficients and roundings).  So ~1 MUFU and ~13 instructions
// a gate instead of 2 and ~19; against softplus(z) the rounding of ex2's argument (|z| 2^-24 relative) dominates from
// |z| ~ 6 on, as in kda_softplus_fast.  z > 20 gives z exactly (log1p(e^-z) < half an ulp of z from z ~ 14.6 on); NaN
// stays NaN, -inf gives 0 and +inf gives +inf.
__device__ __forceinline__ float kda_softplus_poly(float f, float dt_bias) {
    const float z = f + dt_bias;
    const float y = exp2_approx(-1.4426950408889634f * fabsf(z));
    float p = -0.008574675768613815f;
    p = fmaf(p, y, 0.044214192777872086f), p = fmaf(p, y, -0.10785368084907532f), p = fmaf(p, y, 0.17757023870944977f);
    p = fmaf(p, y, -0.2449961155653f), p = fmaf(p, y, 0.3327617645263672f), p = fmaf(p, y, -0.49997448921203613f);
    p = fmaf(p, y, 0.9999998211860657f);
    return fmaxf(z, 0.f) + y * p;
}
