"""Issue 17 experiment: GDN's forward state pass (w, u given, h and R stored, output fused) in
variants: k read transposed from memory (TRANS_K), K held as two 64-row halves (SPLIT), BV, stages.
Checked against fastweight's state_fwd on the same inputs, then timed one by one."""
import os, sys, itertools, time
import torch, triton, triton.language as tl

SMOKE = os.environ.get("SMOKE")
dev = "cpu" if SMOKE else "cuda"


@triton.jit
def exp_kernel(q, k, w, u, g, o, h, r, scale, T, NT: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
               BT: tl.constexpr, BV: tl.constexpr, TRANS_K: tl.constexpr, SPLIT: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos = i_n * T
    o_i = tl.arange(0, BT)
    m_causal = o_i[:, None] >= o_i[None, :]
    HALF: tl.constexpr = K // 2
    if SPLIT:
        b_h1 = tl.zeros([HALF, BV], dtype=tl.float32)
        b_h2 = tl.zeros([HALF, BV], dtype=tl.float32)
    else:
        b_h = tl.zeros([K, BV], dtype=tl.float32)
    for i_t in range(0, NT):
        base = (bos * H + i_h)
        i_s = (i_n * NT + i_t) * H + i_h
        if SPLIT:
            p_h1 = tl.make_block_ptr(h + i_s.to(tl.int64) * K * V, (K, V), (V, 1), (0, i_v * BV), (HALF, BV), (1, 0))
            p_h2 = tl.make_block_ptr(h + i_s.to(tl.int64) * K * V, (K, V), (V, 1), (HALF, i_v * BV), (HALF, BV), (1, 0))
            tl.store(p_h1, b_h1.to(k.dtype.element_ty))
            tl.store(p_h2, b_h2.to(k.dtype.element_ty))
            p_w1 = tl.make_block_ptr(w + base * K, (T, K), (H * K, 1), (i_t * BT, 0), (BT, HALF), (1, 0))
            p_w2 = tl.make_block_ptr(w + base * K, (T, K), (H * K, 1), (i_t * BT, HALF), (BT, HALF), (1, 0))
            p_u = tl.make_block_ptr(u + base * V, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
            b_r = tl.load(p_u).to(tl.float32)
            b_r -= tl.dot(tl.load(p_w1), b_h1.to(k.dtype.element_ty))
            b_r -= tl.dot(tl.load(p_w2), b_h2.to(k.dtype.element_ty))
        else:
            p_h = tl.make_block_ptr(h + i_s.to(tl.int64) * K * V, (K, V), (V, 1), (0, i_v * BV), (K, BV), (1, 0))
            tl.store(p_h, b_h.to(k.dtype.element_ty))
            p_w = tl.make_block_ptr(w + base * K, (T, K), (H * K, 1), (i_t * BT, 0), (BT, K), (1, 0))
            p_u = tl.make_block_ptr(u + base * V, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
            b_r = tl.load(p_u).to(tl.float32) - tl.dot(tl.load(p_w), b_h.to(k.dtype.element_ty))
        p_r = tl.make_block_ptr(r + base * V, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        tl.store(p_r, b_r.to(k.dtype.element_ty))
        b_g = tl.load(g + (bos + i_t * BT + o_i) * H + i_h)
        b_glast = tl.load(g + (bos + i_t * BT + BT - 1) * H + i_h)
        # output
        if SPLIT:
            if TRANS_K:
                p_k1 = tl.make_block_ptr(k + base * K, (K, T), (1, H * K), (0, i_t * BT), (HALF, BT), (0, 1))
                p_k2 = tl.make_block_ptr(k + base * K, (K, T), (1, H * K), (HALF, i_t * BT), (HALF, BT), (0, 1))
                b_k1t, b_k2t = tl.load(p_k1), tl.load(p_k2)
            else:
                p_k1 = tl.make_block_ptr(k + base * K, (T, K), (H * K, 1), (i_t * BT, 0), (BT, HALF), (1, 0))
                p_k2 = tl.make_block_ptr(k + base * K, (T, K), (H * K, 1), (i_t * BT, HALF), (BT, HALF), (1, 0))
                b_k1t, b_k2t = tl.trans(tl.load(p_k1)), tl.trans(tl.load(p_k2))
            p_q1 = tl.make_block_ptr(q + base * K, (T, K), (H * K, 1), (i_t * BT, 0), (BT, HALF), (1, 0))
            p_q2 = tl.make_block_ptr(q + base * K, (T, K), (H * K, 1), (i_t * BT, HALF), (BT, HALF), (1, 0))
            b_q1, b_q2 = tl.load(p_q1), tl.load(p_q2)
            b_o = tl.dot(b_q1, b_h1.to(k.dtype.element_ty)) + tl.dot(b_q2, b_h2.to(k.dtype.element_ty))
            b_A = tl.dot(b_q1, b_k1t) + tl.dot(b_q2, b_k2t)
        else:
            if TRANS_K:
                p_k = tl.make_block_ptr(k + base * K, (K, T), (1, H * K), (0, i_t * BT), (K, BT), (0, 1))
                b_kt = tl.load(p_k)
            else:
                p_k = tl.make_block_ptr(k + base * K, (T, K), (H * K, 1), (i_t * BT, 0), (BT, K), (1, 0))
                b_kt = tl.trans(tl.load(p_k))
            p_q = tl.make_block_ptr(q + base * K, (T, K), (H * K, 1), (i_t * BT, 0), (BT, K), (1, 0))
            b_q = tl.load(p_q)
            b_o = tl.dot(b_q, b_h.to(k.dtype.element_ty))
            b_A = tl.dot(b_q, b_kt)
        b_o = b_o * tl.exp(b_g)[:, None]
        b_A = b_A * tl.exp(tl.where(m_causal, b_g[:, None] - b_g[None, :], float("-inf")))
        b_o = (b_o + tl.dot(b_A.to(k.dtype.element_ty), b_r.to(k.dtype.element_ty))) * scale
        p_o = tl.make_block_ptr(o + base * V, (T, V), (H * V, 1), (i_t * BT, i_v * BV), (BT, BV), (1, 0))
        tl.store(p_o, b_o.to(k.dtype.element_ty))
        b_x = (b_r * tl.exp(b_glast - b_g)[:, None]).to(k.dtype.element_ty)
        if SPLIT:
            b_h1 = b_h1 * tl.exp(b_glast) + tl.dot(b_k1t, b_x)
            b_h2 = b_h2 * tl.exp(b_glast) + tl.dot(b_k2t, b_x)
        else:
            b_h = b_h * tl.exp(b_glast) + tl.dot(b_kt, b_x)


def main():
    from fastweight.bench.gpu_delta import inputs
    from fastweight.kernels.common import prepare_chunks
    from fastweight.kernels.cumsum import chunk_cumsum
    from fastweight.kernels.delta import _pack
    from fastweight.kernels.kkt_solve import kkt_solve
    from fastweight.kernels.state import state_fwd
    from fastweight.kernels.wy import recompute_w_u
    B, T, H, K = (1, 128, 2, 128) if SMOKE else (4, 8192, 16, 128)
    dt = torch.float16 if SMOKE else torch.bfloat16
    x = {n: _pack(t) for n, t in inputs("gated_delta_rule", B, T, H, K, K, dt, dev).items()}
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    ch = prepare_chunks(None, B, T, 64, dev)
    gc = chunk_cumsum(g, ch)
    Ai = kkt_solve(k, beta, gc, ch)
    w, u = recompute_w_u(k, v, beta, gc, Ai, ch)
    scale = K ** -0.5
    kw = dict(g=gc, w=w, u=u, q=q, scale=scale, store_h=True, store_r=True, fuse_output=True)
    h0, r0, o0, _ = state_fwd("delta", k, u, ch, **kw)
    ms = lambda f: triton.testing.do_bench(f, warmup=25, rep=500, return_mode="median")
    if SMOKE:
        ms = lambda f: (f(), 0.0)[1]  # noqa: E731
    if len(sys.argv) < 2:
        print(f"state_fwd (default, BV 64, 4w 2s): {ms(lambda: state_fwd('delta', k, u, ch, **kw)):.4f} ms", flush=True)
    NT = T // 64
    variants = [dict(TRANS_K=tk, SPLIT=sp, BV=bv, num_warps=nw, num_stages=ns)
                for tk, sp, bv, nw, ns in itertools.product((False, True), (False, True), (64, 32), (4, 8), (2, 3))
                if not (bv == 32 and nw == 8)]
    if SMOKE:
        variants = variants[:1] + [variants[-1]]

    def launch(vr, warm=False):
        o, h, r = torch.empty_like(v), torch.empty_like(h0), torch.empty_like(v)
        grid = (K // vr["BV"], B * H)
        exp_kernel[grid](q, k, w, u, gc, o, h, r, scale, T, NT, H=H, K=K, V=K, BT=64, **vr)
        return o, h, r

    # compile in parallel threads (Triton's compile releases the GIL in its subprocess stages)
    def compile_one(vr):
        try:
            grid = (K // vr["BV"], B * H)
            o, h, r = torch.empty_like(v), torch.empty_like(h0), torch.empty_like(v)
            exp_kernel.warmup(q, k, w, u, gc, o, h, r, scale, T, NT, H=H, K=K, V=K, BT=64, grid=grid, **vr)
            return None
        except Exception as e:  # noqa: BLE001
            return repr(e)[:200]
    if len(sys.argv) > 2 and sys.argv[1] == "compile":
        launch(variants[int(sys.argv[2])])
        torch.cuda.synchronize()
        return
    errs = [None] * len(variants)
    if not SMOKE:
        import subprocess
        t0 = time.time()
        procs = [subprocess.Popen([sys.executable, __file__, "compile", str(i)], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE) for i in range(len(variants))]
        for i, p in enumerate(procs):
            _, err = p.communicate()
            if p.returncode:
                errs[i] = err.decode()[-300:]
        print(f"compiled {len(variants)} in {time.time() - t0:.0f} s", flush=True)
    for vr, e in zip(variants, errs):
        tag = " ".join(f"{a}={b}" for a, b in vr.items())
        if e:
            print(f"{tag}: compile failed {e}")
            continue
        try:
            o, h, r = launch(vr)
            err = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in ((o, o0), (h, h0), (r, r0)))
            t = ms(lambda: launch(vr))
            print(f"{tag}: {t:.4f} ms  max rel vs default {err:.2e}", flush=True)
        except Exception as ex:  # noqa: BLE001
            print(f"{tag}: failed {ex!r}"[:300], flush=True)


if __name__ == "__main__":
    main()
