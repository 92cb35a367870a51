"""``fastweight verify``: every mechanism is one DPLR recurrence and one gradient step.

One row per registry entry, and one per variant form of an entry right after it
(``Mechanism.variants``: another form its op computes under an option, such as a ``diagonal_step``
flag), on fresh random inputs (or ``--seed``):

- the mechanism's DPLR parameters in words;
- ``dplr``: rel err of its own recurrence (as in its paper) against the generic DPLR
  recurrence ``S_t = (Diag(w_t) + a_t b_t^T) S_{t-1} + k_t v_t^T`` (outputs and final state,
  from a random initial state);
- ``step``: rel err of its update against one gradient step of its objective (the proximal
  step for Longhorn), at every t;
- status: both within the tolerance of the dtype.

Then the facts of DESIGN.md section 1: the delta rule's three forms agree, the Householder
spectrum, RWKV-7's eigenvalues in [-1, 1]. Exit status 1 if any row fails. The seed's
"six reductions" table, extended to the whole family.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from fastweight import theory
from fastweight.cli import positive_int
from fastweight.mechanisms import REGISTRY, Mechanism, get
from fastweight.testing import generator, rel_err

DTYPES = {"float64": torch.float64, "float32": torch.float32}
# Rounding of a T-step recurrence in the dtype, with room for T up to a few thousand.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


def forms() -> dict[str, Mechanism]:
    """Every form verified, by name: each registry entry, then its variants (``Mechanism.variants``)."""
    out = {}
    for mechanism in REGISTRY.values():
        for form in (mechanism, *mechanism.variants):
            if form.name in out or (form is not mechanism and form.name in REGISTRY):
                raise ValueError(f"variant {form.name!r} of {mechanism.name!r}: the name is taken")
            out[form.name] = form
    return out


def verify_mechanism(mechanism, *, seed: int, length: int, dtype: torch.dtype, batch: int = 2, heads: int = 2,
                     key_dim: int = 16, value_dim: int = 16) -> dict:
    """The row of one mechanism: dict(mechanism, dplr, dplr_err, step_err, ok)."""
    gen = generator(seed)
    x = mechanism.sample(batch, length, heads, key_dim, value_dim, dtype=dtype, device="cpu", generator=gen)
    h0 = torch.randn(batch, heads, key_dim, value_dim, dtype=dtype, generator=gen)
    dplr_err = theory.check_dplr_map(mechanism, x, initial_state=h0)
    step_err = theory.check_gradient_step(mechanism, x, initial_state=h0)
    tol = TOLERANCE[dtype]
    return dict(mechanism=mechanism.name, title=mechanism.title, dplr=mechanism.dplr_in_words,
                dplr_err=dplr_err, step_err=step_err, ok=bool(dplr_err <= tol and step_err <= tol))


def verify_facts(*, seed: int, dtype: torch.dtype, K: int = 16, V: int = 16, n: int = 8) -> list[dict]:
    """The facts of DESIGN.md section 1 as rows: dict(fact, err, ok)."""
    gen = generator(seed + 1)
    tol = TOLERANCE[dtype]
    kw = dict(dtype=dtype, generator=gen)
    S = torch.randn(n, 1, K, V, **kw)
    k = torch.randn(n, 1, K, **kw)
    k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(n, 1, V, **kw)
    beta = 2 * torch.rand(n, 1, **kw)
    forms = theory.delta_rule_forms(S, k, v, beta)
    forms_err = max(rel_err(forms[1], forms[0]), rel_err(forms[2], forms[0]))
    house = torch.eye(K, dtype=dtype) - beta[..., None, None] * k[..., :, None] * k[..., None, :]
    spectrum_err = rel_err(torch.linalg.eigvalsh(house), theory.householder_eigenvalues(beta, K))
    rwkv7 = get("rwkv7")
    x = rwkv7.sample(n, 4, 1, K, V, dtype=dtype, device="cpu", generator=gen)
    eig = torch.cat([theory.transition_eigenvalues(rwkv7, x, t) for t in range(4)])
    spill = float(torch.clamp(eig.real.abs() - 1, min=0).max()) + float(eig.imag.abs().max())
    return [
        dict(fact="delta rule: erase-write = (I - beta k k^T) S + beta k v^T = one SGD step", err=forms_err,
             ok=forms_err <= tol),
        dict(fact="I - beta k^ k^^T: K-1 eigenvalues 1, one 1 - beta (beta in (0, 2))", err=spectrum_err,
             ok=spectrum_err <= tol),
        dict(fact="RWKV-7 transitions: real eigenvalues in [-1, 1] (spill beyond)", err=spill,
             ok=spill <= tol and float(eig.real.max()) < 1),
    ]


def run(*, seed: int | None = None, length: int = 64, dtype: str = "float64", names=None) -> dict:
    """Verify every form of :func:`forms` (or those in ``names``); returns dict(seed, length, dtype, rows, facts,
    ok)."""
    seed = random.randrange(2 ** 31) if seed is None else seed
    dt = DTYPES[dtype]
    every = forms()
    unknown = [n for n in names or () if n not in every]
    if unknown:
        raise ValueError(f"unknown mechanism {unknown[0]!r}; known: {', '.join(every)}")
    rows = [verify_mechanism(every[n], seed=seed, length=length, dtype=dt) for n in (names or every)]
    facts = verify_facts(seed=seed, dtype=dt)
    ok = all(r["ok"] for r in rows) and all(f["ok"] for f in facts)
    return dict(seed=seed, length=length, dtype=dtype, tolerance=TOLERANCE[dt], rows=rows, facts=facts, ok=ok)


def format_table(result: dict) -> str:
    rows = result["rows"]
    width = max(len(r["dplr"]) for r in rows)
    lines = [f"fastweight verify: seed {result['seed']}, T={result['length']}, {result['dtype']}, "
             f"tolerance {result['tolerance']:g}", "",
             f"{'mechanism':<18} {'DPLR parameters':<{width}}  {'own vs DPLR':>11}  {'grad step':>9}  status"]
    for r in rows:
        status = "ok" if r["ok"] else "FAIL"
        errors = f"{r['dplr_err']:11.1e}  {r['step_err']:9.1e}"
        lines.append(f"{r['mechanism']:<18} {r['dplr']:<{width}}  {errors}  {status}")
    lines.append("")
    for f in result["facts"]:
        lines.append(f"{'ok  ' if f['ok'] else 'FAIL'} {f['fact']}: {f['err']:.1e}")
    failed = [r["mechanism"] for r in rows if not r["ok"]] + [f["fact"] for f in result["facts"] if not f["ok"]]
    lines.append("")
    lines.append("all passed" if not failed else f"FAILED: {', '.join(failed)}")
    return "\n".join(lines)


def _main(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    result = run(seed=args.seed, length=args.length, dtype=args.dtype, names=args.mechanism or None)
    result["seconds"] = round(time.perf_counter() - start, 3)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
        print(f"({result['seconds']:.1f} s)")
    return 0 if result["ok"] else 1


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("verify", help="check every mechanism against the DPLR core and its objective",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one, printed)")
    parser.add_argument("--length", type=positive_int, default=64, help="sequence length T (default 64)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float64", help="computation dtype")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--mechanism", action="append", choices=tuple(forms()),
                        help="verify only this mechanism or variant form (repeatable)")
    parser.set_defaults(func=_main)
    return parser


def main(argv=None) -> int:
    from fastweight.cli import run_subcommand
    return run_subcommand(register, "verify", argv)


if __name__ == "__main__":
    sys.exit(main())
