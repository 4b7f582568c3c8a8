#!/usr/bin/env bash
# Which L2 unit binds the prefill MoE GEMM (issue 11): Nsight Compute's breakdown of L2 throughput (the fabric between
# the two L2 partitions, the crossbars to and from the SMs, the tag stage) with the sectors requested by the SMs and
# arriving over the fabric, DRAM bytes and the tensor pipe, for one gate/up launch of the plain kernel, the
# warp-specialized form, that form with the weight rows multicast and that form claiming its items by L2 partition
# (KDA_RT_MOE_WS / KDA_RT_MOE_MC / KDA_RT_MOE_L2_SPLIT).
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
for v in 0:0:0:moe_grouped_gemm_wg 1:0:0:moe_grouped_gemm_ws 1:1:0:moe_grouped_gemm_ws 1:0:1:moe_grouped_gemm_ws; do
  IFS=: read -r ws mc sp k <<< "$v"
  echo "=== KDA_RT_MOE_WS=$ws KDA_RT_MOE_MC=$mc KDA_RT_MOE_L2_SPLIT=$sp"
  KDA_RT_MOE_WS=$ws KDA_RT_MOE_MC=$mc KDA_RT_MOE_L2_SPLIT=$sp timeout 100 "$NCU" --clock-control none -k "regex:$k" --launch-skip 2 \
    --launch-count 1 --metrics "$M" python tests/gpu/bench_moe_gemm.py --once --tokens "$T" 2>&1 \
    | grep -E "lts__|dram__|sm__pipe|gpu__time"
done
