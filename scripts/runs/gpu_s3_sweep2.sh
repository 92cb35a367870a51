# Session 3 run 5: launch-configuration sweeps of the GDN and KDA kernels not swept in run 3 (nvidia-h200-x2), outputs in $OUT.
export PYTHONUNBUFFERED=1 FASTWEIGHT_VALUE_CHECKS=0 PYTHONPATH=.
(CUDA_VISIBLE_DEVICES=0 timeout 170 python -m fastweight.bench.gpu_sweep gated_delta_rule gdn1.3b --warps 2,4,8 --stages 1,2,3 --budget 130 --kernels state.state_output_fwd_kernel,wy.recompute_w_u_kernel,wy.wy_bwd_kernel --out $OUT > $OUT/g0.log 2>&1) &
(CUDA_VISIBLE_DEVICES=1 timeout 170 python -m fastweight.bench.gpu_sweep kda gdn1.3b --warps 4,8 --stages 1,2,3 --budget 130 --kernels kkt_solve.solve_kernel,output.output_bwd_kernel,state.state_output_fwd_kernel,wy.wy_bwd_kernel,state.state_bwd_kernel --out $OUT > $OUT/g1.log 2>&1) &
wait; grep -v Warn $OUT/g0.log $OUT/g1.log | cut -c1-300
