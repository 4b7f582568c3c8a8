// moe_select.cuh — one token's routing decision by one warp (spec §5.2, ungrouped): moe_route.cu's
// moe_route_select_warp and moe_route_fused, and moe_gemv.cu's routed variant (which repeats the fused routing
// kernel's choice for its own units), so the same logits give the same ids in every kernel.
#pragma once

// Orderable key of a float that is not NaN: a > b exactly when order_key(a) > order_key(b) (-0 keys below +0,
// which no score here produces: s >= +0 and s + bias is never -0); order_key(-inf)
// = 0x007fffff, so key 0 stands below every score (an expert that does not exist, or is taken).
__device__ __forceinline__ unsigned order_key(float v) {
    const unsigned u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// top_k rounds of a warp argmax, larger sel first, lower index on ties.
// NEXP experts, top_k <= MAXK; logit(e) returns the token's router logit of expert e (called once per expert).
// Lane l holds experts l, l + 32, ... sorted by (sel descending, index ascending); each round takes the
// largest head key of the warp (redux.sync max), the lowest expert index among the heads with that key
// (redux.sync min; within a lane equal keys are already in index order) and pops it from its lane.
template <int NEXP, int MAXK, typename Logit>
__device__ __forceinline__ void warp_route_token(Logit logit, const float* __restrict__ bias, int top_k,
                                                 int renormalize, int biased, float scaling, int* id_out,
                                                 float* w_out) {
    constexpr int PER = (NEXP + 31) / 32;
    const int lane = threadIdx.x & 31;
    float lg[PER], bs[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {  // every load in flight at once (in the loop below each waited on the last)
        const int e = i * 32 + lane;
        lg[i] = e < NEXP ? logit(e) : 0.f;
        bs[i] = e < NEXP ? bias[e] : 0.f;
    }
    asm volatile("" ::: "memory");
    unsigned key[PER], eid[PER];
    float wv[PER];  // the weight the expert gets if chosen: s, or sel when biased
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int e = i * 32 + lane;
        key[i] = 0u;
        eid[i] = 0xffffffffu;
        wv[i] = 0.f;
        if (e < NEXP) {
            const float s = sigmoid(lg[i]);
            float v = s + bs[i];
            v = v == v ? v : neg_inf();
            key[i] = order_key(v);
            eid[i] = e;
            wv[i] = biased ? v : s;
        }
    }
    // odd-even transposition sort of the lane's PER entries, larger key first; it swaps only strictly
    // smaller keys forward, so equal keys keep their (ascending) index order.  Branch-free selects.
#pragma unroll
    for (int pass = 0; pass < PER; ++pass) {
#pragma unroll
        for (int j = pass & 1; j + 1 < PER; j += 2) {
            const bool sw = key[j + 1] > key[j];
            const unsigned ka = key[j], kb = key[j + 1], ia = eid[j], ib = eid[j + 1];
            const float wa = wv[j], wb = wv[j + 1];
            key[j] = sw ? kb : ka; key[j + 1] = sw ? ka : kb;
            eid[j] = sw ? ib : ia; eid[j + 1] = sw ? ia : ib;
            wv[j] = sw ? wb : wa; wv[j + 1] = sw ? wa : wb;
        }
    }
    int my_id = 0;
    float my_w = 0.f;
#pragma unroll
    for (int k = 0; k < MAXK; ++k) {
        if (k >= top_k) break;  // warp-uniform (top_k <= MAXK)
        const unsigned best = __reduce_max_sync(0xffffffffu, key[0]);
        const unsigned win = __reduce_min_sync(0xffffffffu, key[0] == best ? eid[0] : 0xffffffffu);
        const int owner = (int)(win & 31u);
        const float w_win = __shfl_sync(0xffffffffu, wv[0], owner);
        const bool pop = lane == owner;  // the owner drops its head
#pragma unroll
        for (int j = 0; j + 1 < PER; ++j) {
            key[j] = pop ? key[j + 1] : key[j];
            eid[j] = pop ? eid[j + 1] : eid[j];
            wv[j] = pop ? wv[j + 1] : wv[j];
        }
        key[PER - 1] = pop ? 0u : key[PER - 1];
        eid[PER - 1] = pop ? 0xffffffffu : eid[PER - 1];
        my_id = lane == k ? (int)win : my_id;
        my_w = lane == k ? w_win : my_w;
    }
    float sum = 0.f;
    for (int j = 0; j < top_k; ++j) sum += __shfl_sync(0xffffffffu, my_w, j);  // k order
    *id_out = my_id;
    *w_out = (renormalize ? my_w / (sum + 1e-20f) : my_w) * scaling;
}
