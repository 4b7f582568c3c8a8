// mla_prefill_wg.cuh — the key-tile loop of the two wgmma MLA prefill kernels (mla_prefill_wg.cu on bf16 products,
// mla_prefill_fp8.cu on e4m3 ones; sm_90a only): two warpgroups staggered by half a tile so that one's softmax runs
// under the other's products on the tensor cores, Stages shared-memory stages with Stages - 2 key tiles in flight,
// one block barrier a tile.
#pragma once
#include "wgmma.cuh"

// Between two barriers (one key tile) warpgroup 0 runs scores(it), attend(it) and waits for its P·V, while warpgroup
// 1 runs attend(it - 1) on the scores it kept in registers, then scores(it), whose wait also retires that P·V.  Right
// after the barrier that starts iteration it (every warpgroup is past iteration it - 1, whose waits retired every
// product that read tile it - 2), tile it + Stages - 2 is copied into the stage of tile it - 2 while warpgroup 1
// still reads tile it - 1's values; an empty commit group past the end keeps the count uniform.  The caller has
// issued tiles 0 .. Stages - 3, one commit group each (Q in the first).  The callbacks:
//   load(stage, kb)   copy the tile of keys kb .. kb + BlockN - 1 into the stage at `stage` (cp.async, no commit)
//   first()           once, after the first barrier (Q's registers from shared memory)
//   scores(stage)     s = Q·Kᵀ of the tile in `stage`, waited for
//   attend(kb, v)     mask, softmax and O += P·V of the tile in s, its values at `v` (issued, not waited)
//   retire()          keep the outputs in their registers (fence_regs) after a wait
template <int Stages, int BlockN, class Load, class First, class Scores, class Attend, class Retire>
__device__ __forceinline__ void staggered_key_tiles(int num_tiles, int ks, int wg, unsigned stage0, unsigned stage_bytes,
                                                    unsigned v_offset, Load&& load, First&& first, Scores&& scores,
                                                    Attend&& attend, Retire&& retire) {
    constexpr int Ahead = Stages - 2;
    for (int it = 0; it < num_tiles; ++it) {
        const int kb = ks + it * BlockN;
        cp_async_wait<Ahead - 1>();  // tile it (and Q) have landed (this thread's copies) ...
        fence_proxy_async();         // ... and are visible to the tensor cores' proxy ...
        __syncthreads();             // ... for everyone's copies; and every warpgroup is past iteration it - 1
        if (it + Ahead < num_tiles) load(stage0 + ((it + Ahead) % Stages) * stage_bytes, kb + Ahead * BlockN);
        cp_async_commit();
        if (it == 0) first();
        const unsigned stage = stage0 + (it % Stages) * stage_bytes;
        if (wg == 0) {
            scores(stage);
            attend(kb, stage + v_offset);
            wgmma_wait<0>();
            retire();
        } else {
            if (it > 0) attend(kb - BlockN, stage0 + ((it + Stages - 1) % Stages) * stage_bytes + v_offset);
            scores(stage);
            retire();
        }
    }
    if (wg == 1 && num_tiles > 0) {  // warpgroup 1's last tile
        attend(ks + (num_tiles - 1) * BlockN, stage0 + ((num_tiles - 1) % Stages) * stage_bytes + v_offset);
        wgmma_wait<0>();
        retire();
    }
    cp_async_wait<0>();
}
