"""Writes the signatures of fla's public ops that fastweight also has, as JSON (no fla import needed).

    python -m pip download --no-deps fla-core==0.6.0 -d /tmp/fla && unzip -q /tmp/fla/*.whl -d /tmp/fla/src
    python tests/data/fla_signatures.py /tmp/fla/src 0.6.0 > tests/data/fla_0.6.0_ops.json

Each entry: fla's file, its parameters in order as [name, default source or null], and whether
it takes **kwargs (fla reads some options from them: use_gate_in_kernel, A_log, ...).
"""

import ast
import json
import os
import sys

OPS = ("linear_attn", "retention", "simple_gla", "gla", "rwkv6", "hgrn", "hgrn2", "delta_rule", "gated_delta_rule",
       "gated_delta_product", "kda", "comba", "longhorn", "dplr_delta_rule", "rwkv7", "lightning_attn",
       "iplr_delta_rule")
# fla's other forms of some of them (fused_chunk_gla and fused_chunk_delta_rule only raise in fla 0.6.0)
FORMS = ("fused_chunk_linear_attn", "fused_chunk_retention", "fused_chunk_simple_gla", "fused_chunk_gla",
         "fused_chunk_delta_rule", "parallel_retention", "parallel_simple_gla")


def signatures(root: str) -> dict:
    want = {f"{mode}_{op}" for op in OPS for mode in ("chunk", "fused_recurrent")} | set(FORMS)
    out = {}
    for folder, _, files in sorted(os.walk(os.path.join(root, "fla", "ops"))):
        for name in sorted(files):
            if not name.endswith(".py") or "backends" in folder:
                continue
            path = os.path.join(folder, name)
            for node in ast.parse(open(path).read()).body:
                if isinstance(node, ast.FunctionDef) and node.name in want and node.name not in out:
                    a = node.args
                    params = [x.arg for x in a.posonlyargs + a.args]
                    defaults = [None] * (len(params) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
                    out[node.name] = dict(file=os.path.relpath(path, root), params=list(map(list, zip(params, defaults))),
                                          kwargs=a.kwarg is not None)
    return dict(sorted(out.items()))


if __name__ == "__main__":
    root, version = sys.argv[1], sys.argv[2]
    print(json.dumps(dict(fla_core=version, ops=signatures(root)), indent=1))
