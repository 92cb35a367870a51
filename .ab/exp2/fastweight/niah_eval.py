"""``fastweight niah``: RULER's S-NIAH-1/2/3 on any causal LM, zero-shot, beside Gated DeltaNet's Table 2.

    fastweight niah --model PATH_OR_HF_NAME --lengths 1024,2048,4096,8192 --examples 100 --tasks 1,2,3
    fastweight niah --model runs/eval/niah-gdn --lengths 512,1024,2048 --examples 32   # a `fastweight train` run

``--model`` is one of: a ``fastweight train`` run folder or its ``checkpoint.pt`` (our
LanguageModel; tokenizer: the word-level task tokenizer); a model folder with a ``config.json``:
ours (``FastweightForCausalLM.save_pretrained``, ``fastweight convert`` output), one of fla's
(converted on load) or any ``transformers`` causal LM; or a Hugging Face hub name (its files
fetched with ``huggingface_hub``, then read as a folder: fla's models convert). The tokenizer
is the folder's own unless ``--tokenizer`` names another (a folder or hub name, or ``word``).
The prompts, the length budget and the scoring are ``fastweight.tasks.ruler``'s. Prints the
accuracy table (the paper's rows beside it) and the accuracy per needle depth; writes every
example's prompt length, value, output and verdict to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from fastweight.cli import positive_int
from fastweight.tasks import ruler

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(spec: str):
    """``"word"``: our task tokenizer; else ``AutoTokenizer.from_pretrained(spec)``."""
    if spec == "word":
        from fastweight.tasks.text import tokenizer
        return ruler.TaskTokenizer(tokenizer())
    from transformers import AutoTokenizer
    try:
        return ruler.HFTokenizer(AutoTokenizer.from_pretrained(spec))
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"no tokenizer could be loaded from {spec!r} (`--tokenizer`; by default the model's "
                         f"folder): {str(e).splitlines()[0] if str(e) else type(e).__name__}. Pass --tokenizer "
                         "with a tokenizer folder or hub name, or 'word' for fastweight's task tokenizer") from e


def download(name: str) -> str:
    """The local folder of the Hugging Face hub model ``name`` (config, weights, tokenizer files),
    so that fla's models on the hub convert on load like a local folder."""
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.bin", "*.model", "*.txt"])
    except Exception as e:  # offline, no such repository, an invalid name: all say the same to the user
        raise ValueError(f"`--model` {name!r} is not a local path, and fetching it from the Hugging Face hub "
                         f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e


def _vocab_size(model) -> int:
    from fastweight.models.lm import LanguageModel
    if isinstance(model, LanguageModel):
        return model.cfg.vocab_size
    return model.get_output_embeddings().weight.shape[0]


def load_model(spec: str, tokenizer: str | None = None, device=None, dtype: str | None = None):
    """``(model, tokenizer, kind)`` for ``--model spec`` (see the module docstring), in eval mode on
    ``device`` (default: CUDA if there is one) in ``dtype`` (default bfloat16 on CUDA, float32 on CPU)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"`--model` must be a path or a Hugging Face name, got {spec!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"`--dtype` must be one of {', '.join(DTYPES)}, got {dtype!r}")
    device = torch.device(device if device else "cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[dtype] if dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
    if not os.path.exists(spec):
        spec = download(spec)
    config = os.path.join(spec, "config.json")
    checkpoint = spec if os.path.isfile(spec) else os.path.join(spec, "checkpoint.pt")
    if os.path.isdir(spec) and os.path.isfile(config):
        with open(config) as f:
            model_type = json.load(f).get("model_type")
        from fastweight.models.convert import FLA_MODELS
        from fastweight.models.hf import FastweightForCausalLM
        if model_type == "fastweight" or model_type in FLA_MODELS:
            model, kind = FastweightForCausalLM.from_pretrained(spec).model, f"fastweight ({model_type})"
        else:
            from transformers import AutoModelForCausalLM
            model, kind = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype), f"transformers ({model_type})"
        default_tokenizer = spec
    elif os.path.isfile(checkpoint):
        from fastweight.models import LanguageModel, LMConfig
        from fastweight.train import load_checkpoint
        state = load_checkpoint(checkpoint)
        model = LanguageModel(LMConfig.from_dict(state["model_config"]))
        model.load_state_dict(state["model"])
        kind, default_tokenizer = f"fastweight train checkpoint ({model.cfg.mixer})", "word"
    else:
        raise ValueError(f"`--model` {spec}: neither a model folder (config.json) nor a `fastweight train` "
                         "checkpoint (checkpoint.pt)")
    tok = load_tokenizer(tokenizer or default_tokenizer)
    if tok.vocab_size > _vocab_size(model):
        raise ValueError(f"the tokenizer {tokenizer or default_tokenizer!r} has {tok.vocab_size} tokens, more than "
                         f"the model's {_vocab_size(model)} (`--tokenizer`: the one the model was trained with)")
    return model.to(device=device, dtype=dtype).eval(), tok, kind


def run(model: str, *, tokenizer=None, tasks=(1, 2, 3), lengths=ruler.PAPER_LENGTHS, examples: int = 100,
        seed: int = 0, depths: int = 5, extra_tokens: int = 8, device=None, dtype=None, progress: bool = False):
    """Load ``model`` and score it (``ruler.score``); returns ``(result, description dict)``."""
    net, tok, kind = load_model(model, tokenizer, device, dtype)
    result = ruler.score(net, tok, tasks=tasks, lengths=lengths, examples=examples, seed=seed, depths=depths,
                         extra_tokens=extra_tokens, progress=progress)
    param = next(net.parameters())
    return result, dict(model=model, kind=kind, tokenizer=tokenizer, device=str(param.device),
                        dtype=str(param.dtype).removeprefix("torch."))


COLORS = {"deltanet": "tab:blue", "mamba2": "tab:orange", "gdn": "tab:green", "kda": "tab:red", "rwkv7": "tab:purple"}
PAPER_MIXERS = {"DeltaNet 1.3B": "deltanet", "Mamba2 1.3B": "mamba2", "Gated DeltaNet 1.3B": "gdn"}


def plot_against_paper(out: str, suite: str | None = None, results=()) -> str:
    """Accuracy against length per S-NIAH task. Top row: Table 2's 1.3B models (solid) and any
    ``fastweight niah`` JSON ``results`` (dashed). Bottom row, with ``suite`` (a ``fastweight
    eval`` suite.json): its S-NIAH models, trained from scratch, exact match (solid) and the
    per-character accuracy (dotted), which still tells the mixers apart where every exact match is 0."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = 2 if suite else 1
    fig, axes = plt.subplots(rows, 3, figsize=(12, 3.4 * rows), squeeze=False, sharex=True)
    for task, ax in zip((1, 2, 3), axes[0]):
        for name, row in ruler.PAPER_TABLE2.items():
            ax.plot(ruler.PAPER_LENGTHS[: len(row[task])], row[task], "o-", color=COLORS[PAPER_MIXERS[name]],
                    label=f"{name} (Table 2)")
        for path in results:
            with open(path) as f:
                data = json.load(f)
            if str(task) in data["scores"]:
                xs = sorted(int(n) for n in data["scores"][str(task)])
                ax.plot(xs, [data["scores"][str(task)][str(n)] for n in xs], "s--",
                        label=os.path.basename(os.path.normpath(data["model"])))
        ax.set_title(f"S-NIAH-{task}: zero-shot, pretrained", fontsize=9)
    if suite:
        with open(suite) as f:
            runs = [r for r in json.load(f)["results"] if r["eval"] and r["eval"][0]["task"].startswith("s_niah")]
        for task, ax in zip((1, 2, 3), axes[1]):
            for run in runs:
                evals = [e for e in run["eval"] if e["task"].startswith(f"s_niah_{task}:")]
                xs = [int(e["task"].split("context_len=")[1].split(",")[0]) for e in evals]
                color = COLORS.get(run["label"])
                ax.plot(xs, [100 * e["seq_acc"] for e in evals], "o-", color=color, label=run["label"])
                if task == 3:
                    ax.plot(xs, [100 * e["token_acc"] for e in evals], "o:", color=color)
            ax.set_title(f"S-NIAH-{task}: trained from scratch" + (" (dotted: per character)" if task == 3 else
                                                                   f" ({os.path.basename(suite)})"), fontsize=9)
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_ylim(-3, 103)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("exact match (%)")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def _int_list(name: str, allowed=None):
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be comma-separated ints, got {text!r}") from None
        bad = [v for v in values if (v not in allowed if allowed else v < 1)]
        if bad:
            raise argparse.ArgumentTypeError(f"{name} must be " + (f"among {sorted(allowed)}" if allowed else
                                                                  "positive") + f", got {bad}")
        return values
    return parse


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("niah", help="RULER's S-NIAH-1/2/3 on any causal LM, zero-shot",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a model folder, a `fastweight train` run or checkpoint.pt, "
                        "or a Hugging Face name")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer folder or name, or 'word' (default: the "
                        "model folder's; the word tokenizer for a train checkpoint)")
    parser.add_argument("--lengths", type=_int_list("--lengths"), default=ruler.PAPER_LENGTHS,
                        help="context lengths in the model's tokens, prompt plus answer (default 1024,2048,4096,8192)")
    parser.add_argument("--examples", type=positive_int, default=100, help="examples per task and length")
    parser.add_argument("--tasks", type=_int_list("--tasks", set(ruler.TASKS)), default=(1, 2, 3),
                        help="S-NIAH variants (default 1,2,3)")
    parser.add_argument("--depths", type=positive_int, default=5, help="needle depths, evenly spaced on [0, 1]")
    parser.add_argument("--extra-tokens", type=int, default=8, help="tokens generated beyond the value's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--out", default=None, help="JSON of every example (default runs/niah/<model name>.json)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=False)
    parser.set_defaults(func=_run)
    return parser


def _run(args) -> int:
    result, info = run(args.model, tokenizer=args.tokenizer, tasks=args.tasks, lengths=args.lengths,
                       examples=args.examples, seed=args.seed, depths=args.depths, extra_tokens=args.extra_tokens,
                       device=args.device, dtype=args.dtype, progress=args.progress)
    name = os.path.basename(os.path.normpath(args.model)) or "model"
    out = args.out or os.path.join("runs", "niah", f"{name}.json")
    print(f"S-NIAH zero-shot: {args.model} [{info['kind']}, {info['dtype']}, {info['device']}], "
          f"{args.examples} examples per cell, greedy, exact match (%)\n")
    print(result.table(name))
    print(f"\nby needle depth ({name}):\n")
    print(result.depth_table())
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump({**info, **result.to_dict()}, f, indent=1)
    print(f"\nwrote {out}")
    return 0


def main(argv=None) -> int:
    from fastweight.cli import run_subcommand
    return run_subcommand(register, "niah", argv)


if __name__ == "__main__":
    sys.exit(main())
