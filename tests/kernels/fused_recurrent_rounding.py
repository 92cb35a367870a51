"""Rounding oracles of the fused recurrent kernels' tests: how far fp32 arithmetic can be from the
float64 reference for a given input, measured from that input in float64.

``rounding_tolerances``: the gradients the kernels form by contracting the state (or its gradient)
with a per-token vector, to ROUNDING ulp of their condition. ``gate_identity_allowances``: the gate
gradient of a loss on the final state, which the kernels' cumsum identity sums from parts that cancel.
Imported by name (pyproject's pythonpath) by tests/kernels/test_fused_recurrent.py.
"""

import torch

from fastweight.kernels import fused_recurrent as fr

# test_strong_gate_in_kernel's S.sum() gate gradients, past STATE_LOSS_GATE_TOL where the input makes the
# identity's rounding larger: its end term rowsum(dht * P_T) sums the final state's entries, which cancel in
# fp32 to a gradient that can be far smaller than sum |P_T|, so the accuracy fp32 allows is eps times the
# identity's parts (gate_identity_magnitudes) over ||dg||, a property of the input, not of the dtype. Measured
# error / (eps * parts / ||dg||) where that exceeds STATE_LOSS_GATE_TOL (fp32, S.sum(), seeds 0-199 / 0-99): GDN
# at -6 up to 0.10 (16 of 200 seeds; dg up to 9.3e-5, 3 seeds past 5e-5), at -20 0.07 (dg 3.3e-4), KDA at -6
# 0.07, at -20 0.23 (dg 3.1e-4): a factor of 1, the allowance capped at 10x the tolerance
GATE_IDENTITY_ROUNDING = 1.0


# A gradient that the kernels form by contracting the state, or its gradient, with a per-token
# vector (the generic call's names) is held to ROUNDING ulp of its condition where that is more than
# the tolerance (rounding_tolerances), and so is the initial state, through the first step's map
# (INITIAL); the gates' parameters and u have their own rules. ROUNDING: measured err / (eps * condition)
# up to 0.34 (rounding_tolerances)
CONTRACTED = ("q", "k", "v", "beta", "p", "a", "b")
# and the gates, whose gradient contracts dS_t with the decayed state w_t S_{t-1}: under strong decay
# and a random dS that sum cancels too (test_strong_gates_lengths[comba-T1], seed 5244958226200527512:
# dg cond 1489, error 1.11e-5 = 0.063 eps * cond); the cumsum identity's own rules stay (_check)
GATE_INPUTS = ("g", "gk", "g_gamma")
# dh0 = dS_{-1} = Diag(w_0) dS_0 + b_0 (a_0^T dS_0): under a strong decay a rank-one sum over K that
# cancels like dv's (test_strong_gates[comba--20.0], seed 1944582310230221081, loss on o: cond 1306,
# error 4.23e-5 = 0.27 eps * cond; the fp32 reference's 1.44e-5 = 0.09)
INITIAL = "initial_state"
FP32_EPS = torch.finfo(torch.float32).eps
ROUNDING = 1.0


def contraction_magnitudes(spec, scale, cu_seqlens, x, do, dht) -> dict:
    """The magnitudes of the generic step's gradients, float64, by the generic input's name.

    The step's own quantities (states S_{t-1}, S_t, the state gradient dS_t, r_t, dr_t) exact in
    float64, and the absolute value taken where a gradient contracts them: ``|dS_t|^T |k_t|`` for
    dv_t, ``|dS_t| |v_t|`` for dk_t, ``|dS_t| |r_t|`` for da_t, ``|S_{t-1}| (|dS_t|^T |a_t|)`` for db_t,
    ``scale |S_t| |do_t|`` for dq_t (S_{t-1} with RWKV-6's readout; its bonus adds ``|c_t| |do_t|``
    to dv_t, c_t = scale q_t . (u k_t)). Under ``INITIAL`` (with an initial state) dS_0 through the first step's
    map: ``|w_0| |dS_0| + |b_0| (|dS_0|^T |a_0|)`` (plus ``scale |q_0| |do_0|`` with RWKV-6's
    readout), per sequence. ``do``, ``dht``: the cotangents (None: not in the loss).
    """
    with torch.no_grad():
        gen, _ = fr.generic_inputs(spec, {n: x.get(n) for n in fr.TENSORS}, scale)
    d = {n: None if t is None else t.detach().double() for n, t in gen.items()}
    q, k, v, a, b, g = (d[n] for n in ("q", "k", "v", "a", "b", "g"))
    B, T, HV, K = q.shape
    w = torch.ones_like(k) if g is None else (g.exp() if g.dim() == 4 else g.exp()[..., None].expand_as(k))
    do = torch.zeros_like(v) if do is None else do.double().expand_as(v)
    h0 = x.get("initial_state")
    prev = spec.bonus
    mag = {n: torch.zeros_like(d[n]) for n in ("q", "k", "v", "a", "b") if d[n] is not None}
    if g is not None:
        mag["g"] = torch.zeros_like(g)
    if h0 is not None:
        mag[INITIAL] = torch.zeros_like(h0, dtype=torch.float64)
    bounds = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    for i in range(len(bounds) - 1):
        # rows of the tokens' tensors, of the per-sequence states (N = B, or one per sequence, B = 1)
        rows, seq = (slice(None), slice(None)) if cu_seqlens is None else (slice(0, 1), slice(i, i + 1))
        bos, eos = bounds[i], bounds[i + 1]
        S = torch.zeros(B if cu_seqlens is None else 1, HV, K, v.shape[-1], dtype=torch.float64)
        if h0 is not None:
            S = h0[seq].detach().double()
        states, rs = [S], []
        for t in range(bos, eos):
            if a is not None:
                rs.append(torch.einsum("bhk,bhkv->bhv", b[rows, t], S))
                S = w[rows, t, ..., None] * S + a[rows, t, ..., None] * rs[-1][..., None, :]
            else:
                S = w[rows, t, ..., None] * S
            S = S + k[rows, t, ..., None] * v[rows, t, ..., None, :]
            states.append(S)
        dS = torch.zeros_like(S) if dht is None else dht[seq].double().expand_as(S)
        for t in range(eos - 1, bos - 1, -1):
            j, readout = t - bos, scale * q[rows, t, ..., None] * do[rows, t, ..., None, :]
            if not prev:
                dS = dS + readout
            mag["v"][rows, t] = torch.einsum("bhkv,bhk->bhv", dS.abs(), k[rows, t].abs())
            if g is not None:
                # the log gate's: dS_t . (w_t S_{t-1}), summed over V (and K for a scalar gate)
                decayed = (w[rows, t, ..., None] * states[j]).abs()
                per_k = torch.einsum("bhkv,bhkv->bhk", dS.abs(), decayed)
                mag["g"][rows, t] = per_k if g.dim() == 4 else per_k.sum(-1)
            mag["k"][rows, t] = torch.einsum("bhkv,bhv->bhk", dS.abs(), v[rows, t].abs())
            read = states[j] if prev else states[j + 1]
            mag["q"][rows, t] = scale * torch.einsum("bhkv,bhv->bhk", read.abs(), do[rows, t].abs())
            dS_prev = w[rows, t, ..., None] * dS
            if a is not None:
                mag["a"][rows, t] = torch.einsum("bhkv,bhv->bhk", dS.abs(), rs[j].abs())
                dr_mag = torch.einsum("bhkv,bhk->bhv", dS.abs(), a[rows, t].abs())
                mag["b"][rows, t] = torch.einsum("bhkv,bhv->bhk", states[j].abs(), dr_mag)
                dr = torch.einsum("bhkv,bhk->bhv", dS, a[rows, t])
                dS_prev = dS_prev + b[rows, t, ..., None] * dr[..., None, :]
            if t == bos and h0 is not None:
                first = w[rows, t, ..., None] * dS.abs()
                if a is not None:
                    first = first + b[rows, t, ..., None].abs() * dr_mag[..., None, :]
                mag[INITIAL][seq] = first + readout.abs() if prev else first
            dS = dS_prev + readout if prev else dS_prev
    if spec.bonus:
        c = scale * (q * x["u"].detach().double() * k).sum(-1, keepdim=True)
        mag["v"] = mag["v"] + c.abs() * do.abs()
    return mag


def rounding_tolerances(call, leaves: dict, do, dht, grads: dict, tol: float) -> dict:
    """Tolerances by leaf name: ``max(tol, ROUNDING * eps * cond)`` for the contracted inputs (CONTRACTED),
    the gates (GATE_INPUTS) and the initial state (INITIAL).

    The kernels compute in fp32, the gradient dv_t = dS_t^T k_t (and dk_t = dS_t v_t, dbeta_t =
    k_t . dS_t (v_t - r_t), ...) as sums over K or V: their rounding, and that of the input maps
    (beta k) and of dS_t, is a few ulp of the terms' magnitude ``|dS_t|^T |k_t|``. Relative to the
    gradient that is ``eps * cond``, ``cond = ||magnitude|| / ||gradient||`` (componentwise, measured
    here in float64 from the inputs and cotangents): no fp32 kernel, nor the fp32 reference, does
    better. For random inputs cond is 2-10 (tens with S.sum()), eps * cond far below tol; it is large
    when the tokens that carry the gradient's norm cancel over K or V: strong decays leave the last
    tokens only, and a loss on the state alone (``S.sum()``: dS_{T-1} = ones) makes all of dv_{T-1}
    one number, ``beta_{T-1} sum_i k_{T-1, i}`` (dbeta_{T-1} = ``sum_i k_i sum_j (v_j - r_j)``). Seed
    17229561136897202262 of test_strong_gates[simple_gla_gamma--3.0]: ``sum_i k_i = -1.48e-4`` from
    terms of magnitude 2.71, fp32 error 3.1e-8 (an ulp of the partial sums, ~0.3; 2.1e-4 of that
    token's dv), dv cond 955, error 1.1e-5 = 0.10 eps * cond (the fp32 reference: 3.3e-6); seed
    9638460932912336081 of test_strong_gate_in_kernel[kda-dtype0--6.0]: dv cond 419, error 1.36e-5
    (0.27); seed 11238603488100825133 there: dbeta cond 8658, error 1.88e-5 (0.02: nested sums' bound,
    loose where dS is exact). Worst measured 0.34 eps * cond (last keys made to cancel, as in
    test_cancelling_last_keys, 9 ops at -3/-6/-20), so ROUNDING = 1.

    The magnitude of a leaf's gradient is that of its generic inputs' (contraction_magnitudes)
    through the absolute value of the input map: the gradient of ``sum |G(x)| * magnitude(G)``
    (exact for maps that are products, beta k, exp(g) k). ``call``: what ``test_fused_recurrent._generic_calls``
    recorded; ``leaves``: the run's inputs by the test's names (the recorded tensors are these);
    ``grads``: the reference's gradients by those names.

    The initial state's gradient ``dS_{-1} = Diag(w_0) dS_0 + b_0 (a_0^T dS_0)`` is such a sum over K:
    under a strong decay with a rank-one transition it is the last term alone, cancelling as dv's does.
    Seed 1944582310230221081 of test_strong_gates[comba--20.0], loss on o (and on both): cond 1306, error
    4.23e-5 = 0.27 eps * cond (the fp32 reference: 1.44e-5, 0.09).
    """
    spec, scale, cu_seqlens, x = call
    names = {id(t): n for n, t in leaves.items()}
    mine = {m: x[m] for m in CONTRACTED + GATE_INPUTS if isinstance(x.get(m), torch.Tensor) and id(x[m]) in names}
    h0 = x.get(INITIAL)
    own = isinstance(h0, torch.Tensor) and id(h0) in names and names[id(h0)] in grads
    if not mine and not own:
        return {}
    mag = contraction_magnitudes(spec, scale, cu_seqlens, x, do, dht)
    first = mag.pop(INITIAL, None)
    out = {}
    if own:
        # the state enters the first step as itself: its magnitude is the first step's, unmapped
        cond = first.norm().item() / (grads[names[id(h0)]].norm().item() or 1.0)
        out[names[id(h0)]] = max(tol, ROUNDING * FP32_EPS * cond)
    if not mine:
        return out
    with torch.enable_grad():
        gen, bonus = fr.generic_inputs(spec, {n: x.get(n) for n in fr.TENSORS}, scale)
        total = sum((gen[n].double().abs() * m).sum() for n, m in mag.items() if n != "g")
        if bonus is not None and do is not None:
            total = total + (bonus.double().abs() * do.double().abs()).sum()
        found = torch.autograd.grad(total, list(mine.values()), allow_unused=True, retain_graph=True)
        if "g" in mag and gen["g"].requires_grad:
            # the log gate enters the step linearly (its map from the leaf: identity, a sum over
            # tokens for g_gamma, Mamba-2's softplus): its magnitude pulled back through that map
            through = torch.autograd.grad((gen["g"].double() * mag["g"]).sum(), list(mine.values()),
                                          allow_unused=True)
            found = [f if t is None else (t.abs() if f is None else f.abs() + t.abs()) for f, t in zip(found, through)]
    for m, f in zip(mine, found):
        n = names[id(x[m])]
        if f is not None and n in grads:
            cond = f.double().norm().item() / (grads[n].norm().item() or 1.0)
            out[n] = max(tol, ROUNDING * FP32_EPS * cond)
    return out


def gate_identity_magnitudes(call, do, dht) -> torch.Tensor:
    """The magnitude of the parts that the kernels' gate identity sums for each token's log-gate
    gradient (``fused_recurrent_bwd._gate_gradient``), float64, in the generic gate's shape.

    ``dgk_t`` is summed from the end, ``rowsum(dht * P_T) + sum_{s >= t} terms_s``, or from the start,
    ``rowsum(dP_{-1} * h0) - sum_{s < t} terms_s``, the side whose parts are smaller; its fp32 rounding
    is a few ulp of those parts: the end term's ``|dht| |P_T|`` (summed over V), the start term's
    ``|dP_{-1}| |h0|`` and per token ``scale |q_s| (|P_s| |do_s|) + |k_s| (|dP_s| |v_s|) + |a_s|
    (|dP_s| |r_s|) + |b_{s+1}| (|P_s| |dr_{s+1}|)`` (the last token's writes left out), exact here in
    float64. A scalar gate's is the sum over K. ``call``: what ``test_fused_recurrent._generic_calls`` recorded (no
    varlen, no RWKV-6 readout); ``do``, ``dht``: the cotangents (None: not in the loss).
    """
    spec, scale, cu_seqlens, x = call
    assert cu_seqlens is None and not spec.bonus
    with torch.no_grad():
        gen, _ = fr.generic_inputs(spec, {n: x.get(n) for n in fr.TENSORS}, scale)
    d = {n: None if t is None else t.detach().double() for n, t in gen.items()}
    q, k, v, a, b, g = (d[n] for n in ("q", "k", "v", "a", "b", "g"))
    B, T, HV, K = q.shape
    w = g.exp() if g.dim() == 4 else g.exp()[..., None].expand_as(k)
    do = torch.zeros_like(v) if do is None else do.double().expand_as(v)
    S = torch.zeros(B, HV, K, v.shape[-1], dtype=torch.float64)
    if x.get("initial_state") is not None:
        S = x["initial_state"].detach().double()
    h0, dht = S, torch.zeros_like(S) if dht is None else dht.double().expand_as(S)
    P, r = [], []
    for t in range(T):
        if a is not None:
            r.append(torch.einsum("bhk,bhkv->bhv", b[:, t], S))
        P.append(w[:, t, ..., None] * S)
        S = P[t] + k[:, t, ..., None] * v[:, t, ..., None, :]
        if a is not None:
            S = S + a[:, t, ..., None] * r[t][..., None, :]
    # dP_t = Diag(w_{t+1}) dS_{t+1} (dht at the last token), dr_t = dS_t^T a_t
    dP, dr, dS_next = [None] * T, [None] * (T + 1), dht
    for t in range(T - 1, -1, -1):
        dP[t] = dS_next if t == T - 1 else w[:, t + 1, ..., None] * dS_next
        dS_next = dP[t] + scale * q[:, t, ..., None] * do[:, t, ..., None, :]
        if a is not None:
            if t + 1 < T:
                dS_next = dS_next + b[:, t + 1, ..., None] * dr[t + 1][..., None, :]
            dr[t] = torch.einsum("bhkv,bhk->bhv", dS_next, a[:, t])
    dP_initial = w[:, 0, ..., None] * dS_next

    def mag(M, y):
        return torch.einsum("bhkv,bhv->bhk", M.abs(), y.abs())

    size = torch.stack([scale * q[:, t].abs() * mag(P[t], do[:, t]) for t in range(T)], 1)
    for t in range(T - 1):
        size[:, t] += k[:, t].abs() * mag(dP[t], v[:, t])
        if a is not None:
            size[:, t] += a[:, t].abs() * mag(dP[t], r[t]) + b[:, t + 1].abs() * mag(P[t], dr[t + 1])
    end = (dht.abs() * P[T - 1].abs()).sum(-1)[:, None]
    start = (dP_initial.abs() * h0.abs()).sum(-1)[:, None]
    after = size.flip(1).cumsum(1).flip(1)
    out = torch.minimum(start + after[:, :1] - after, end + after)
    return out if g.dim() == 4 else out.sum(-1)


def gate_identity_allowances(call, do, dht, g_ref, leaves: dict, dg: torch.Tensor, grads: dict) -> dict:
    """``GATE_IDENTITY_ROUNDING * eps * ||magnitude|| / ||gradient||`` for Mamba-2's gate parameters
    (``g``, ``A_log``, ``dt_bias`` of ``leaves``, the reference's float64 leaves; ``g_ref`` their log
    gate, ``dg`` its gradient, ``grads`` theirs): the identity's magnitudes (gate_identity_magnitudes)
    pulled back through the gate's map, whose derivatives are all negative. A_log's and dt_bias's
    relative to ``sum_t |dg_t dg_t/dtheta|``, as check_gradients scales them by that sum over |dtheta|.
    """
    magnitude = gate_identity_magnitudes(call, do, dht).view_as(g_ref)
    names = ("g", "A_log", "dt_bias")
    pulled = torch.autograd.grad((g_ref * magnitude).sum(), [leaves[n] for n in names], retain_graph=True)
    sums = torch.autograd.grad((g_ref * dg.abs()).sum(), [leaves[n] for n in names[1:]], retain_graph=True)
    norms = [grads["g"].norm().item()] + [s.norm().item() for s in sums]
    return {n: GATE_IDENTITY_ROUNDING * FP32_EPS * p.norm().item() / (m or 1.0)
            for n, p, m in zip(names, pulled, norms)}
