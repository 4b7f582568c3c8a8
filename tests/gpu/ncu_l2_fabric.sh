#!/usr/bin/env bash
# Which L2 unit binds the prefill MoE GEMM (issue 11): Nsight Compute's breakdown of L2 throughput (the fabric between
# the two L2 partitions, the crossbars to and from the SMs, the tag stage) with the sectors requested by the SMs and
# arriving over the fabric, DRAM bytes and the tensor pipe, for one gate/up launch of the plain kernel (its weight
# rows by cp.async, then by tensor-map copies), the warp-specialized form and that form with the weight rows
# multicast (KDA_RT_MOE_B_TMA / _WS / _MC), and the WS form with its tensor maps' L2 promotion at 128 bytes and none
# (KDA_RT_TMA_L2_PROMOTION; default 256).
#   bash tests/gpu/ncu_l2_fabric.sh [T]        (default 16384 tokens; bf16 weights and sources)
# Ran on the H200 on 2026-12-03 (forty-second session: docs/PERFORMANCE.md, "the L2 unit that binds").
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
T=${1:-16384}
M=breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed
M=$M,lts__t_sectors.sum,lts__t_sectors_srcunit_tex.sum,lts__t_sectors_srcunit_ltcfabric.sum
M=$M,lts__t_sectors_srcunit_tex_lookup_hit.sum,lts__t_requests_srcunit_tex.sum,dram__bytes_read.sum
M=$M,dram__bytes_write.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
M=$M,gpu__time_duration.sum
# launches 1-2 are run_once's warm-up pair (gate/up, down): the third is the gate/up looked at
# (name, switches, kernel): the plain kernel by cp.async and by tensor-map weight copies, then the WS forms
for v in "plain|KDA_RT_MOE_WS=0 KDA_RT_MOE_B_TMA=0|moe_grouped_gemm_wg" \
         "plain B_TMA|KDA_RT_MOE_WS=0 KDA_RT_MOE_B_TMA=1|moe_grouped_gemm_wg" \
         "WS|KDA_RT_MOE_WS=1 KDA_RT_MOE_MC=0|moe_grouped_gemm_ws" \
         "WS + MC|KDA_RT_MOE_WS=1 KDA_RT_MOE_MC=1|moe_grouped_gemm_ws" \
         "WS, L2 promotion 128|KDA_RT_MOE_WS=1 KDA_RT_MOE_MC=0 KDA_RT_TMA_L2_PROMOTION=128|moe_grouped_gemm_ws" \
         "WS, no L2 promotion|KDA_RT_MOE_WS=1 KDA_RT_MOE_MC=0 KDA_RT_TMA_L2_PROMOTION=none|moe_grouped_gemm_ws"; do
  IFS='|' read -r name switches k <<< "$v"
  echo "=== $name ($switches)"
  # shellcheck disable=SC2086
  env $switches timeout 100 "$NCU" --clock-control none -k "regex:$k" --launch-skip 2 --launch-count 1 \
    --metrics "$M" python tests/gpu/bench_moe_gemm.py --once --tokens "$T" 2>&1 \
    | grep -E "lts__|dram__|sm__pipe|gpu__time"
done
