"""``fastweight niah`` (fastweight/niah_eval.py): every kind of model folder loads and is scored end to end."""

import json

import pytest
import torch

from fastweight import cli
from fastweight.tasks import ruler


def bpe_tokenizer():
    """A byte-level BPE tokenizer trained here on the haystacks (no hub access in CI)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([" ".join(ruler.haystack_words("essay")[0]), ruler.NOISE], vocab_size=1000,
                            special_tokens=["<s>", "</s>"], show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>")


def tiny_lm(vocab_size=753, mixer="gdn"):
    from fastweight.models import LanguageModel, LMConfig
    torch.manual_seed(0)
    return LanguageModel(LMConfig.preset("tiny", mixer=mixer, vocab_size=vocab_size, d_model=32, n_layers=2,
                                         n_heads=2))


def niah(args, capsys):
    status = cli.main(["niah", *args])
    out, err = capsys.readouterr()
    return status, out, err


def check_run(out_json, stdout, tasks, lengths, examples):
    data = json.loads(out_json.read_text())
    assert [int(t) for t in data["scores"]] == list(tasks)
    assert all(list(map(int, row)) == list(lengths) for row in data["scores"].values())
    assert len(data["records"]) == len(tasks) * len(lengths) * examples
    assert all(0.0 <= s <= 100.0 for row in data["scores"].values() for s in row.values())
    assert "Gated DeltaNet 1.3B (Table 2)" in stdout and "by needle depth" in stdout
    return data


def test_a_saved_fastweight_model_with_the_word_tokenizer(tmp_path, capsys):
    from fastweight.models.hf import FastweightForCausalLM
    FastweightForCausalLM.from_language_model(tiny_lm()).save_pretrained(tmp_path / "fw")
    status, out, err = niah(["--model", str(tmp_path / "fw"), "--tokenizer", "word", "--lengths", "160",
                             "--examples", "1", "--tasks", "1,2", "--extra-tokens", "1", "--device", "cpu",
                             "--out", str(tmp_path / "r.json")],
                            capsys)
    assert status == 0, err
    data = check_run(tmp_path / "r.json", out, (1, 2), (160,), 1)
    assert data["kind"] == "fastweight (fastweight)" and data["dtype"] == "float32"
    assert out.splitlines()[2].startswith("| model | S-NIAH-1 160 | S-NIAH-2 160 |")


def test_a_transformers_model_folder_with_its_own_tokenizer(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path / "llama")
    bpe_tokenizer().save_pretrained(tmp_path / "llama")
    status, out, err = niah(["--model", str(tmp_path / "llama"), "--lengths", "300,400", "--examples", "1",
                             "--tasks", "2", "--out", str(tmp_path / "r.json")], capsys)
    assert status == 0, err
    data = check_run(tmp_path / "r.json", out, (2,), (300, 400), 1)
    assert data["kind"] == "transformers (llama)"
    assert all(r["prompt_tokens"] + r["max_new_tokens"] <= r["length"] for r in data["records"])


def test_a_train_checkpoint_and_an_fla_folder(tmp_path, capsys):
    from fastweight.models.convert import save_fla
    model = tiny_lm(mixer="deltanet")
    (tmp_path / "run").mkdir()
    torch.save(dict(model=model.state_dict(), optimizer={}, step=0, curve=[], config={},
                    model_config=model.cfg.to_dict()), tmp_path / "run" / "checkpoint.pt")
    save_fla(model, tmp_path / "fla")
    outputs = []
    for spec, extra in ((tmp_path / "run", []), (tmp_path / "fla", ["--tokenizer", "word"])):
        status, out, err = niah(["--model", str(spec), *extra, "--lengths", "160", "--examples", "1", "--tasks", "1",
                                 "--extra-tokens", "1", "--out", str(tmp_path / "r.json")], capsys)
        assert status == 0, err
        outputs.append(check_run(tmp_path / "r.json", out, (1,), (160,), 1))
    assert outputs[0]["kind"] == "fastweight train checkpoint (deltanet)"
    assert outputs[1]["kind"] == "fastweight (delta_net)"
    assert outputs[0]["records"] == outputs[1]["records"]  # the same weights, converted on load


@pytest.mark.parametrize("args, message", [
    (["--tasks", "4"], "argument --tasks: --tasks must be among [1, 2, 3], got [4]"),
    (["--lengths", "1k"], "argument --lengths: --lengths must be comma-separated ints"),
    (["--lengths", "0,1024"], "argument --lengths: --lengths must be positive, got [0]"),
    (["--examples", "0"], "argument --examples: must be a positive int"),
    (["--dtype", "float8"], "argument --dtype: invalid choice")])
def test_bad_arguments_are_refused_by_name(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["niah", "--model", str(tmp_path), *args])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_folder_that_holds_no_model_or_no_tokenizer_is_an_error_naming_it(tmp_path, capsys):
    from fastweight.models.hf import FastweightForCausalLM
    status, _, err = niah(["--model", str(tmp_path)], capsys)
    assert status == 2 and "`--model`" in err and "checkpoint.pt" in err
    FastweightForCausalLM.from_language_model(tiny_lm(vocab_size=64)).save_pretrained(tmp_path / "fw")
    status, _, err = niah(["--model", str(tmp_path / "fw"), "--examples", "1"], capsys)
    assert status == 2 and "`--tokenizer`" in err
    status, _, err = niah(["--model", str(tmp_path / "fw"), "--tokenizer", "word", "--examples", "1"], capsys)
    assert status == 2 and "753 tokens, more than the model's 64" in err


def test_a_hub_name_that_cannot_be_fetched_is_an_error_naming_it(monkeypatch, capsys):
    import huggingface_hub

    def offline(name, **kwargs):
        raise OSError(f"no cached snapshot of {name}, and no network")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    status, _, err = niah(["--model", "some-org/some-model", "--examples", "1"], capsys)
    assert status == 2 and "`--model` 'some-org/some-model' is not a local path" in err and "no network" in err


def test_the_figure_against_table_2(tmp_path, capsys):
    from pathlib import Path

    from fastweight.niah_eval import plot_against_paper
    (tmp_path / "r.json").write_text(json.dumps(dict(model="runs/m", scores={"1": {"1024": 50.0, "2048": 25.0}})))
    suite = Path(__file__).parents[1] / "docs" / "results" / "full_suite.json"
    out = plot_against_paper(str(tmp_path / "fig.png"), suite=str(suite), results=[str(tmp_path / "r.json")])
    assert Path(out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
