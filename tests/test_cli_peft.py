"""The command line on a PEFT adapter saved alone (``adapter_config.json`` beside its
weights, no config.json): merged into its base model on load, or refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from peft import LoraConfig, PeftModel, PromptTuningConfig, get_peft_model
from test_cli import SENTENCES, WORDS, _tokenizer, run_cli

from captum_attention.loading import CheckpointError, checkpoint_task, load_causal_lm, load_classifier

PROMPT = "the secret code is seven . what is the code ?"


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    """A pretrained encoder (a BertModel, its pooler included) and its tokenizer."""
    folder = tmp_path_factory.mktemp("peft_base") / "encoder"
    config = tf.BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=48, max_position_embeddings=64, initializer_range=0.3)
    torch.manual_seed(0)
    tf.BertModel(config).save_pretrained(folder)
    _tokenizer(folder).save_pretrained(folder)
    return folder


def _lora(task_type: str, targets: list[str]) -> LoraConfig:
    return LoraConfig(task_type=task_type, r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)


@pytest.fixture(scope="module")
def lora_classifier(encoder, tmp_path_factory):
    """A LoRA adapter of a 3-label classifier trained from the 2-label encoder, saved
    alone (the base's tokenizer serves it), and the same model merged and saved whole."""
    root = tmp_path_factory.mktemp("peft_classifier")
    torch.manual_seed(1)
    base = tf.BertForSequenceClassification.from_pretrained(encoder, num_labels=3)
    adapted = get_peft_model(base, _lora("SEQ_CLS", ["query", "value"]))
    adapter, merged = root / "adapter", root / "merged"
    adapted.save_pretrained(adapter)
    adapted.merge_and_unload().save_pretrained(merged)
    _tokenizer(root).save_pretrained(merged)
    return adapter, merged


@pytest.fixture(scope="module")
def lora_llm(llm, tmp_path_factory):
    """A LoRA adapter of the tiny Llama saved alone with its tokenizer and its base's
    config, and the same model merged and saved whole."""
    root = tmp_path_factory.mktemp("peft_llm")
    model, tokenizer = load_causal_lm(llm)
    torch.manual_seed(2)
    adapted = get_peft_model(model, _lora("CAUSAL_LM", ["q_proj", "v_proj", "o_proj"]))
    adapter, merged = root / "adapter", root / "merged"
    adapted.save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    model.config.save_pretrained(adapter)  # as some trainers save the base's config beside it
    adapted.merge_and_unload().save_pretrained(merged)
    tokenizer.save_pretrained(merged)
    return adapter, merged


def test_a_classifiers_adapter_is_merged_into_its_base_with_its_head(lora_classifier, encoder):
    """Its head (3 labels, saved by the adapter) on the base's encoder (2 labels in its
    config), as PEFT computes it unmerged."""
    adapter, _ = lora_classifier
    assert checkpoint_task(adapter) == "classification"
    model, tokenizer = load_classifier(adapter)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    base = tf.BertForSequenceClassification.from_pretrained(encoder, num_labels=3)
    unmerged = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        expected = unmerged(**batch).logits
        torch.testing.assert_close(model(**batch).logits, expected, atol=1e-5, rtol=1e-4)
    assert model.config.num_labels == 3 and model.name_or_path == model.config._name_or_path == str(adapter)
    assert not any("lora" in name for name, _ in model.named_parameters())


def _without_timings(printed: str) -> list[str]:
    return [line for line in printed.splitlines() if " ms" not in line and "written to" not in line]


def _scores(path) -> list[float]:
    sentences = json.loads(path.read_text())["sentences"]
    return [value for sentence in sentences for _, scores in sorted(sentence["scores"].items()) for value in scores]


def test_explain_on_an_adapter_equals_explain_on_its_merged_model(lora_classifier, tmp_path):
    adapter, merged = lora_classifier
    outputs = []
    for folder in (adapter, merged):
        path = tmp_path / f"{folder.name}.json"
        result = run_cli("explain", *SENTENCES, "--model", str(folder), "--methods", "grad_sam,attn_lrp,norm_attention",
                         "--raw", "--json", str(path))
        assert result.returncode == 0, result.stderr
        outputs.append((_without_timings(result.stdout.replace(str(folder), "MODEL")), _scores(path)))
    assert outputs[0][0] == outputs[1][0]
    torch.testing.assert_close(torch.tensor(outputs[0][1]), torch.tensor(outputs[1][1]), atol=1e-5, rtol=1e-4)


def test_a_language_models_adapter_answers_and_explains_as_its_merged_model(lora_llm, tmp_path):
    adapter, merged = lora_llm
    assert checkpoint_task(adapter) == "generation"
    printed = []
    for folder in (adapter, merged):
        result = run_cli("explain", "--model", str(folder), PROMPT, "--max-new-tokens", "2", "--methods", "grad_sam,alti_logit")
        assert result.returncode == 0, result.stderr
        printed.append(_without_timings(result.stdout.replace(str(folder), "MODEL")))
    assert printed[0] == printed[1]


def _refused(folder, match: str) -> None:
    with pytest.raises(CheckpointError, match=match) as raised:
        load_classifier(folder)
    assert "\n" not in str(raised.value)


def test_weights_in_no_file_are_refused_not_drawn_at_random(encoder, tmp_path):
    """A base saved without the pooler the classifier reads (a masked LM's), which the
    adapter does not save either; a checkpoint whose config names a head its weights lack."""
    base_folder = tmp_path / "masked_lm"
    config = tf.BertConfig.from_pretrained(encoder)
    tf.BertForMaskedLM(config).save_pretrained(base_folder)
    _tokenizer(tmp_path).save_pretrained(base_folder)
    base = tf.BertForSequenceClassification.from_pretrained(base_folder)
    get_peft_model(base, _lora("SEQ_CLS", ["query"])).save_pretrained(tmp_path / "adapter")
    _refused(tmp_path / "adapter", r"bert\.pooler\.dense\.bias, bert\.pooler\.dense\.weight are neither in its base model .* nor in the adapter")
    headless = tmp_path / "headless"
    headless.mkdir()
    for file in encoder.iterdir():
        (headless / file.name).write_bytes(file.read_bytes())
    settings = json.loads((headless / "config.json").read_text())
    (headless / "config.json").write_text(json.dumps({**settings, "architectures": ["BertForSequenceClassification"]}))
    _refused(headless, r"classifier\.bias, classifier\.weight are in none of its files, so they would be random")


def test_adapters_that_cannot_be_merged_or_found_are_one_line(encoder, tmp_path):
    base = tf.BertForSequenceClassification.from_pretrained(encoder)
    prompt_tuned = get_peft_model(base, PromptTuningConfig(task_type="SEQ_CLS", num_virtual_tokens=4))
    prompt_tuned.save_pretrained(tmp_path / "prompt")
    _refused(tmp_path / "prompt", r"holds a PROMPT_TUNING adapter, whose learned virtual tokens")
    (tmp_path / "lost").mkdir()
    (tmp_path / "lost" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "no-such/model"}))
    _refused(tmp_path / "lost", r"adapter of 'no-such/model', which is neither a folder nor a model in the local Hugging Face cache")
    result = run_cli("explain", "a film", "--model", str(tmp_path / "lost"))
    assert result.returncode == 1 and result.stderr.strip().count("\n") == 0


def test_a_base_model_named_by_its_hub_id_is_read_from_the_local_cache(lora_classifier, encoder, tmp_path, monkeypatch):
    """An adapter trained from a hub model names its id; the cached snapshot serves (the
    hub is never asked)."""
    import shutil

    import huggingface_hub.constants

    adapter, merged = lora_classifier
    snapshot = tmp_path / "hub" / "models--tiny--encoder" / "snapshots" / "0123abcd"
    shutil.copytree(encoder, snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    by_id = tmp_path / "adapter"
    shutil.copytree(adapter, by_id)
    settings = json.loads((by_id / "adapter_config.json").read_text())
    (by_id / "adapter_config.json").write_text(json.dumps({**settings, "base_model_name_or_path": "tiny/encoder"}))
    model, tokenizer = load_classifier(by_id)
    expected, _ = load_classifier(merged)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, expected(**batch).logits, atol=1e-5, rtol=1e-4)
