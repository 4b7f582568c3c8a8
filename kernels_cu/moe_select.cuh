// moe_select.cuh — one token's routing decision by one warp, for ungrouped routing (spec §5.2), used by
// moe_route.cu's moe_route_select_warp.
//
// Lane l holds experts l, l + 32, ...: s = sigmoid(logit), sel = s + bias (a NaN sel ranks as -inf).
// top_k rounds of a warp argmax over the experts not taken yet, larger sel first and the lower index
// on ties: the order of moe_route_select's rank counting (a stable descending sort), so ids and weights
// are bit-identical to it.  Lane k < top_k ends with the k-th id and its weight: s (sel when biased),
// divided by (sum + 1e-20) with the sum added in k order when renormalising, times scaling.
#pragma once

// NE experts; logit(e) returns the token's router logit of expert e (called once per expert).
template <int NE, typename Logit>
__device__ __forceinline__ void warp_route_token(Logit logit, const float* __restrict__ bias, int top_k,
                                                 int renormalize, int biased, float scaling, int* id_out,
                                                 float* w_out) {
    constexpr int PER = (NE + 31) / 32;
    const int lane = threadIdx.x & 31;
    float s[PER], sel[PER];
    unsigned taken = 0u;  // bit i: expert i·32 + lane is chosen already (or does not exist)
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int e = i * 32 + lane;
        s[i] = 0.f;
        sel[i] = neg_inf();
        if (e < NE) {
            s[i] = sigmoid(logit(e));
            const float v = s[i] + bias[e];
            sel[i] = v == v ? v : neg_inf();
        } else {
            taken |= 1u << i;
        }
    }
    int my_id = 0;
    float my_w = 0.f;
    for (int k = 0; k < top_k; ++k) {
        float best = neg_inf();
        int best_e = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < PER; ++i) {  // ascending index within the lane: strict > keeps the lowest
            if (!((taken >> i) & 1u) && (best_e == 0x7fffffff || sel[i] > best)) {
                best = sel[i];
                best_e = i * 32 + lane;
            }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, off);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, off);
            if (oe != 0x7fffffff && (best_e == 0x7fffffff || ov > best || (ov == best && oe < best_e))) {
                best = ov;
                best_e = oe;
            }
        }
        // best_e is the same in every lane now; its owner takes it and hands out its unbiased score
        const int owner = best_e & 31, slot = best_e >> 5;
        float mine = 0.f;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            if (i == slot) mine = s[i];
        }
        const float s_win = __shfl_sync(0xffffffffu, mine, owner);
        if (lane == owner) taken |= 1u << slot;
        if (lane == k) {
            my_id = best_e;
            my_w = biased ? best : s_win;
        }
    }
    float sum = 0.f;
    for (int j = 0; j < top_k; ++j) sum += __shfl_sync(0xffffffffu, my_w, j);  // k order
    *id_out = my_id;
    *w_out = (renormalize ? my_w / (sum + 1e-20f) : my_w) * scaling;
}
