"""The command line for causal language models: the answer, each method's prompt tokens,
the HTML report with a heat matrix per method."""

from __future__ import annotations

import unicodedata

import pytest
import torch
from lm_models import CHAT_TEMPLATE, make_decoder, make_word_tokenizer
from test_cli import run_cli

from captum_attention import GradSAM, LLMAttentionAttribution
from captum_attention.presentation.cli import main

PROMPT = "the secret code is seven . what is the code ?"


def test_explain_generates_the_answer_and_names_each_methods_top_tokens(llm, tmp_path):
    html = tmp_path / "answer.html"
    result = run_cli("explain", "--model", str(llm), PROMPT, "--max-new-tokens", "3", "--per-token", "--html", str(html))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "answer, generated (greedy), 3 tokens:" in out
    for method in ("Grad-SAM", "Attention Rollout", "Transformer Attribution", "Raw Attention", "AttnLRP"):
        assert f"{method} (" in out
    assert out.count(" <- ") == 3 * 5, "each of the 3 answer tokens per method"
    page = html.read_text(encoding="utf-8")
    assert page.count('<table class="matrix">') == 5 and page.count("<section>") == 5
    assert not any(unicodedata.category(c) == "Cc" for c in page.replace("\n", ""))


def test_the_printed_shares_are_the_llm_interfaces_seq_attr(llm, capsys):
    assert main(["explain", "--model", str(llm), PROMPT, "--target", "seven", "--methods", "grad_sam", "--raw"]) == 0
    out = capsys.readouterr().out
    assert "answer, given, 1 token:" in out
    line = out.splitlines()[out.splitlines().index(next(l for l in out.splitlines() if l.startswith("Grad-SAM"))) + 1]
    printed = [(token.split("[")[0], float(value)) for token, value in (cell.split() for cell in line.strip().split(" | "))]
    model, tokenizer = make_decoder("llama"), make_word_tokenizer()
    from captum.attr import TextTokenInput

    result = LLMAttentionAttribution(GradSAM(model), tokenizer).attribute(TextTokenInput(PROMPT, tokenizer), target="seven")
    words = [(value, token) for token, value in zip(result.input_tokens, result.seq_attr.tolist()) if token != "<s>"]
    expected = [(token, value) for value, token in sorted(words, reverse=True)[:5]]
    assert [t for t, _ in printed] == [t for t, _ in expected]
    torch.testing.assert_close(torch.tensor([v for _, v in printed]), torch.tensor([v for _, v in expected]), rtol=1e-3, atol=0)


def test_a_long_prompt_from_a_file_and_clear_errors(llm, tmp_path, capsys):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(" ".join([PROMPT] * 3), encoding="utf-8")
    assert main(["explain", "--model", str(llm), "--file", str(prompt_file), "--target", "seven", "--methods", "raw"]) == 0
    assert "prompt: 34 tokens" in capsys.readouterr().out
    assert main(["explain", "--model", str(llm), "one", "two"]) == 1
    assert "one prompt at a time" in capsys.readouterr().err
    assert main(["explain", "--model", str(llm), PROMPT, "--max-new-tokens", "0"]) == 1
    err = capsys.readouterr().err
    assert "--max-new-tokens must be at least 1, got 0" in err and "--ig-steps" not in err
    prompt_file.write_text(" ".join([PROMPT] * 6), encoding="utf-8")  # 67 tokens: more than the 64 positions
    assert main(["explain", "--model", str(llm), "--file", str(prompt_file), "--target", "seven"]) == 1
    err = capsys.readouterr().err
    assert "the prompt's 67 tokens and --target's 1 token are more than the 64 the model takes" in err
    assert err.count("\n") == 1


def test_the_target_is_counted_in_tokens_against_the_models_limit(llm, tmp_path, capsys):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(" ".join([PROMPT] * 5), encoding="utf-8")  # 56 tokens
    assert main(["explain", "--model", str(llm), "--file", str(prompt_file), "--target", "seven . seven . seven"]) == 0
    capsys.readouterr()
    long_target = " ".join(["seven ."] * 5)  # 10 tokens: 66 in all
    assert main(["explain", "--model", str(llm), "--file", str(prompt_file), "--target", long_target]) == 1
    assert "the prompt's 56 tokens and --target's 10 tokens are more than the 64" in capsys.readouterr().err


def test_a_generation_cut_at_the_token_limit_is_warned_about(llm, tmp_path, capsys):
    html = tmp_path / "answer.html"
    assert main(["explain", "--model", str(llm), PROMPT, "--max-new-tokens", "2", "--methods", "raw", "--html", str(html)]) == 0
    captured = capsys.readouterr()
    assert "warning: the answer stopped at --max-new-tokens (2) without an end token" in captured.err
    assert "Warning: the answer stopped at --max-new-tokens (2)" in html.read_text(encoding="utf-8")
    assert main(["explain", "--model", str(llm), PROMPT, "--target", "seven", "--methods", "raw"]) == 0
    assert "warning" not in capsys.readouterr().err
    assert main(["explain", "--model", str(llm), PROMPT, "--max-new-tokens", "1", "--methods", "raw"]) == 0
    assert "warning" not in capsys.readouterr().err, "a first token asked for alone runs past nothing"


def test_an_answer_ended_by_another_of_generates_end_tokens_is_no_cut(llm, tmp_path, capsys):
    """Llama-3 stops at its end of turn, which is not its tokenizer's end token: an answer
    that ends there at the limit was warned about as cut."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = AutoModelForCausalLM.from_pretrained(llm), AutoTokenizer.from_pretrained(llm)
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    second = int(model.generate(prompt, max_new_tokens=2, do_sample=False)[0, -1])
    assert second != tokenizer.eos_token_id
    stops = tmp_path / "stops"
    shutil.copytree(llm, stops)
    settings = json.loads((stops / "generation_config.json").read_text())
    (stops / "generation_config.json").write_text(json.dumps({**settings, "eos_token_id": [tokenizer.eos_token_id, second]}))
    assert main(["explain", "--model", str(stops), PROMPT, "--max-new-tokens", "2", "--methods", "raw"]) == 0
    assert "stopped at --max-new-tokens" not in capsys.readouterr().err


def test_words_the_vocabulary_does_not_hold_are_warned_about(llm, capsys):
    """A word-level tokenizer whose unknown token is its pad token reads unknown words as
    padding: the report left them out as special tokens, with an empty top list and no word
    of why."""
    assert main(["explain", "--model", str(llm), "zebra quokka", "--target", "seven", "--methods", "raw"]) == 0
    captured = capsys.readouterr()
    assert "warning: the tokenizer read 2 of the prompt's 3 tokens as <pad>: words its vocabulary does not hold" in captured.err
    assert "(no prompt token to rank: every one is a special token)" in captured.out
    assert main(["explain", "--model", str(llm), PROMPT + " zebra", "--target", "seven", "--methods", "raw"]) == 0
    assert "read 1 of the prompt's" in capsys.readouterr().err


def test_skip_leaves_the_matching_tokens_out_as_captums_skip_tokens(llm, capsys):
    import json

    from captum.attr import TextTokenInput

    assert main(["explain", "--model", str(llm), PROMPT, "--target", "seven", "--methods", "grad_sam", "--skip", "the|[.?]"]) == 0
    out = capsys.readouterr().out
    assert "prompt: 8 tokens explained, 4 skipped by --skip" in out
    top = out.splitlines()[next(i for i, l in enumerate(out.splitlines()) if l.startswith("Grad-SAM")) + 1]
    assert not any(cell.split()[0].split("[")[0] in ("the", ".", "?") for cell in top.strip().split(" | "))
    model, tokenizer = make_decoder("llama"), make_word_tokenizer()
    inp = TextTokenInput(PROMPT, tokenizer, skip_tokens=["the", ".", "?"])
    expected = LLMAttentionAttribution(GradSAM(model), tokenizer).attribute(inp, target="seven")
    path = llm.parent / "skipped.json"
    assert main(["explain", "--model", str(llm), PROMPT, "--target", "seven", "--methods", "grad_sam", "--skip", "the|[.?]",
                 "--json", str(path)]) == 0
    written = json.loads(path.read_text(encoding="utf-8"))
    assert written["prompt_tokens"] == expected.input_tokens and written["skipped"] == ["the", ".", "the", "?"]
    torch.testing.assert_close(torch.tensor(written["seq_attr"]["Grad-SAM"]), expected.seq_attr)
    assert main(["explain", "--model", str(llm), PROMPT, "--skip", "("]) == 1
    assert "--skip '(' is not a regular expression" in capsys.readouterr().err
    for every_word in ("[a-z?.]+", ".*"):
        assert main(["explain", "--model", str(llm), PROMPT, "--target", "seven", "--skip", every_word]) == 1
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and f"skip {every_word!r} matches every prompt token but the special ones" in error


def test_a_byte_level_tokenizers_tokens_are_shown_and_skipped_as_words(tmp_path):
    """GPT-2's, Llama-3's and Qwen2's tokens carry their space as a mark ("Ġthe"): --skip
    'the' matched only a prompt's first word, and the report showed the marks. The prompt's
    tokens are shown, and matched, as Captum shows the answer's ("the"); the scores are
    those of Captum's skip_tokens with every " the" left out. An answer given without the
    space these tokenizers do not add is read glued to the prompt, and the report says so."""
    import transformers as tf
    from lm_models import make_byte_level_tokenizer

    from captum.attr import TextTokenInput
    from captum_attention.presentation.answer import explain_answer

    prompt = "the cat sat on the mat, the dog sat on the"
    tokenizer = make_byte_level_tokenizer(prompt + " mat.")
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=64)).eval()
    raw = tokenizer.convert_ids_to_tokens(tokenizer.encode(prompt))
    assert "Ġthe" in raw and "Ġmat" in raw
    explanation = explain_answer(model, tokenizer, prompt, " mat", methods=["grad_sam"], skip="the|,")
    words = [token.replace("Ġ", "") for token in raw]
    assert explanation.skipped == [w for w in words if w in ("the", ",")] and explanation.skipped.count("the") == 4
    assert explanation.prompt_tokens == [w for w in words if w not in ("the", ",")]
    inp = TextTokenInput(prompt, tokenizer, skip_tokens=sorted({t for t, w in zip(raw, words) if w in ("the", ",")}))
    expected = LLMAttentionAttribution(GradSAM(model), tokenizer).attribute(inp, target=" mat")
    torch.testing.assert_close(torch.tensor(explanation.seq_attr["Grad-SAM"]), expected.seq_attr)
    assert explanation.warnings == []
    glued = explain_answer(model, tokenizer, prompt, "mat", methods=["raw"]).warnings  # "the" + "mat": "themat"
    assert len(glued) == 1 and "read glued to the prompt's last word, as 'themat': begin it with a space (' mat')" in glued[0]


def test_attn_lrp_at_a_presence_explains_the_answer_with_the_prompt_weighed_down(llm, tmp_path, capsys):
    """The prompt's tokens (the skipped ones too) at ``--presence``, its special tokens and
    the answer at 1: the LLM interface's seq_attr of AttnLRP with that presence."""
    import json

    from captum.attr import TextTokenInput

    from captum_attention import AttnLRP

    path = tmp_path / "presence.json"
    assert main(["explain", "--model", str(llm), PROMPT, "--target", "seven .", "--methods", "attn_lrp_presence",
                 "--presence", "0.1", "--skip", "the", "--per-token", "--json", str(path)]) == 0
    written = json.loads(path.read_text(encoding="utf-8"))
    model, tokenizer = make_decoder("llama"), make_word_tokenizer()
    inp = TextTokenInput(PROMPT, tokenizer, skip_tokens=["the"])
    prompt = inp.to_model_input()
    presence = torch.cat([torch.where(prompt == tokenizer.bos_token_id, 1.0, 0.1), torch.ones(1, 2)], dim=1)
    assert presence[0, 1:-2].eq(0.1).all() and presence[0, 0] == 1
    expected = LLMAttentionAttribution(AttnLRP(model), tokenizer).attribute(inp, target="seven .", presence=presence)
    torch.testing.assert_close(torch.tensor(written["seq_attr"]["AttnLRP at presence 0.1"]), expected.seq_attr)
    torch.testing.assert_close(torch.tensor(written["token_attr"]["AttnLRP at presence 0.1"]), expected.token_attr)
    plain = LLMAttentionAttribution(AttnLRP(model), tokenizer).attribute(inp, target="seven .")
    assert not torch.allclose(expected.seq_attr, plain.seq_attr, rtol=0.05), "the presence moves the scores"


@pytest.mark.parametrize(
    "method, display, exact, by_share",
    [("leave_one_out_estimates", "Leave-one-out estimates", 2, False),
     ("leave_one_out_estimates_by_share", "Leave-one-out estimates, by share", 7, True)],
)
def test_the_leave_one_out_estimates_explain_the_answer_on_request(llm, tmp_path, method, display, exact, by_share):
    """``--methods leave_one_out_estimates``: KnockoutGradient's first-order leave-one-out
    effects, the two prompt tokens AttnLRP ranks highest deleted exactly; ``..._by_share``:
    the seven of largest first-order effect over one minus their attention share (the BOS
    token and the ``--skip`` tokens never removed). Refused for a classifier before any
    work."""
    import json

    from captum.attr import TextTokenInput

    from captum_attention import AttnLRP, KnockoutGradient
    from captum_attention.metrics import attention_shares

    path = tmp_path / "estimates.json"
    html = tmp_path / "estimates.html"
    assert main(["explain", "--model", str(llm), PROMPT, "--target", "seven .", "--methods", f"grad_sam,{method}",
                 "--skip", "[.]", "--per-token", "--json", str(path), "--html", str(html)]) == 0
    assert html.read_text(encoding="utf-8").count("this method explains the whole answer only") == 1, "its section, not Grad-SAM's"
    written = json.loads(path.read_text(encoding="utf-8"))
    scores = torch.tensor(written["seq_attr"][display])
    assert written["answer_tokens"] == ["seven", "."] and display not in written["token_attr"]
    model, tokenizer = make_decoder("llama"), make_word_tokenizer()
    inp = TextTokenInput(PROMPT, tokenizer, skip_tokens=["."])  # AttnLRP's second of all tokens
    prompt, answer = inp.to_model_input(), torch.tensor([tokenizer.convert_tokens_to_ids(["seven", "."])])
    features = inp.itp_mask[0]
    removable = features & (prompt[0] != tokenizer.bos_token_id)

    def log_prob(ids: torch.Tensor) -> float:
        with torch.no_grad():
            logits = model(input_ids=torch.cat([ids, answer], dim=1)).logits[0, ids.shape[1] - 1 : -1]
        return float(logits.log_softmax(-1).gather(1, answer[0][:, None]).sum())

    mask = torch.ones_like(prompt)
    span = lambda method: method.attribute_span(prompt, answer, additional_forward_args=(mask,))[0, : prompt.shape[1]].detach()  # noqa: E731
    first_order = span(KnockoutGradient(model))
    if by_share:
        segments = torch.arange(prompt.shape[1]).masked_fill(~removable, -1)[None]
        ranked = first_order.abs() / (1 - attention_shares(model, prompt, mask, answer, segments)[0])
    else:
        ranked = span(AttnLRP(model)).abs()
    chosen = ranked.masked_fill(~removable, -1).argsort(descending=True)[:exact]
    expected = first_order.clone()
    for position in chosen.tolist():
        expected[position] = log_prob(prompt) - log_prob(prompt[:, torch.arange(prompt.shape[1]) != position])
    expected = expected.masked_fill(~removable, 0.0)[features]
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-5)
    assert (scores != first_order[features]).sum() >= exact, "the exact deletions replace the first order"
    refused = run_cli("explain", "good", "--methods", method).stderr
    assert refused.count("\n") == 1
    assert f"{method} explains a language model's answer, not a classifier's prediction: leave it out." in refused


def test_every_registered_method_explains_the_answer_on_request(llm, tmp_path, capsys):
    """``--methods`` takes any registered method: its whole-answer and per-token scores are
    the LLM interface's; Attention Flow, which has no span, is refused before any work."""
    import json

    from captum.attr import TextTokenInput

    from captum_attention.attr import REGISTRY

    chosen = ["norm_attention", "value_zeroing", "alti", "alti_logit", "learned_attention", "knockout_gradient", "knockout_lrp", "decompx"]
    path = tmp_path / "registered.json"
    assert main(["explain", "--model", str(llm), PROMPT, "--target", "seven .", "--methods", ",".join(chosen), "--per-token",
                 "--json", str(path)]) == 0
    written = json.loads(path.read_text(encoding="utf-8"))
    model, tokenizer = make_decoder("llama"), make_word_tokenizer()
    for name in chosen:
        expected = LLMAttentionAttribution(REGISTRY[name](model), tokenizer).attribute(TextTokenInput(PROMPT, tokenizer), target="seven .")
        display = REGISTRY[name].get_name()
        torch.testing.assert_close(torch.tensor(written["seq_attr"][display]), expected.seq_attr)
        torch.testing.assert_close(torch.tensor(written["token_attr"][display]), expected.token_attr)
    assert written["methods"]["ALTI-Logit"] == {"uses_target": True, "signed": True}
    capsys.readouterr()
    assert main(["explain", "--model", str(llm), PROMPT, "--methods", "raw,attention_flow"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "attention_flow explains one answer token at a time, not a whole answer: leave it out." in captured.err
    for classifiers_only in ("attn_lrp_presence_calibrated", "attn_lrp_half_contexts"):
        assert main(["explain", "--model", str(llm), PROMPT, "--methods", f"raw,{classifiers_only}"]) == 1
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1
        assert f"{classifiers_only} explains a classifier's prediction, not an answer: leave it out." in captured.err


def test_json_holds_every_methods_scores_and_the_answer(llm, tmp_path, capsys):
    import json

    path = tmp_path / "answer.json"
    assert main(["explain", "--model", str(llm), PROMPT, "--target", "seven .", "--per-token", "--json", str(path)]) == 0
    written = json.loads(path.read_text(encoding="utf-8"))
    assert written["answer_tokens"] == ["seven", "."] and not written["generated"]
    assert set(written["seq_attr"]) == {"Grad-SAM", "Attention Rollout", "Transformer Attribution", "Raw Attention", "AttnLRP"}
    assert all(len(rows) == 2 and len(rows[0]) == len(written["prompt_tokens"]) for rows in written["token_attr"].values())
    assert main(["explain", "--model", str(llm), PROMPT, "--json", str(tmp_path)]) == 1
    assert "is a folder" in capsys.readouterr().err


def test_a_first_token_the_models_generate_forces_is_shown_and_said_to_be_read_not_explained(seq2seq, tmp_path, capsys):
    """A translation model's target language (generation_config.forced_bos_token_id): the
    answer shows it, the whole-answer scores are those of the tokens after it."""
    import json
    import shutil

    forcing = tmp_path / "forcing"
    shutil.copytree(seq2seq, forcing)
    settings = json.loads((forcing / "generation_config.json").read_text())
    (forcing / "generation_config.json").write_text(json.dumps({**settings, "forced_bos_token_id": 7}))
    assert main(["explain", "--model", str(forcing), PROMPT, "--target", "seven", "--methods", "raw"]) == 0
    captured = capsys.readouterr()
    forced = make_word_tokenizer().convert_ids_to_tokens(7)
    assert f"warning: the answer's first token, {forced!r}, is the one the model's generate forces there" in captured.err
    assert f"answer, given, 2 tokens:\n  {forced} seven" in captured.out
    assert main(["explain", "--model", str(seq2seq), PROMPT, "--target", "seven", "--methods", "raw"]) == 0
    assert "forces there" not in capsys.readouterr().err


def test_explain_takes_a_sequence_to_sequence_model_and_prints_the_source_tokens(seq2seq, tmp_path, capsys):
    html = tmp_path / "answer.html"
    assert main(["explain", "--model", str(seq2seq), PROMPT, "--max-new-tokens", "3", "--per-token", "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "answer, generated (greedy), 3 tokens:" in out and out.count(" <- ") == 3 * 5
    assert main(["explain", "--model", str(seq2seq), PROMPT, "--target", "seven", "--methods", "grad_sam", "--raw"]) == 0
    out = capsys.readouterr().out
    line = out.splitlines()[out.splitlines().index(next(l for l in out.splitlines() if l.startswith("Grad-SAM"))) + 1]
    printed = [(token.split("[")[0], float(value)) for token, value in (cell.split() for cell in line.strip().split(" | "))]
    from captum.attr import TextTokenInput
    from lm_models import make_encoder_decoder

    tokenizer = make_word_tokenizer()
    result = LLMAttentionAttribution(GradSAM(make_encoder_decoder("bart")), tokenizer).attribute(
        TextTokenInput(PROMPT, tokenizer), target="seven"
    )
    words = [(value, token) for token, value in zip(result.input_tokens, result.seq_attr.tolist()) if token != "<s>"]
    expected = [(token, value) for value, token in sorted(words, reverse=True)[:5]]
    assert [t for t, _ in printed] == [t for t, _ in expected]
    torch.testing.assert_close(torch.tensor([v for _, v in printed]), torch.tensor([v for _, v in expected]), rtol=1e-3, atol=0)
    import json

    from captum_attention.presentation.explain import answer_integrated_gradients

    report = tmp_path / "ig.json"
    assert main(["explain", "--model", str(seq2seq), PROMPT, "--target", "seven", "--methods", "integrated_gradients",
                 "--ig-steps", "4", "--json", str(report)]) == 0
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    answer = tokenizer("seven", add_special_tokens=False, return_tensors="pt").input_ids
    expected = answer_integrated_gradients(make_encoder_decoder("bart"), ids, answer, 4)[0]
    written = json.loads(report.read_text(encoding="utf-8"))["seq_attr"]["Integrated Gradients"]
    assert expected.abs().max() > 0
    torch.testing.assert_close(torch.tensor(written), expected, rtol=1e-4, atol=1e-6)
    assert main(["explain", "--model", str(seq2seq), PROMPT, "--methods", "attn_lrp_presence,alti,leave_one_out_estimates"]) == 1
    assert (
        "attn_lrp_presence, alti, leave_one_out_estimates explain one self-attention stack, not an encoder-decoder nor"
        in capsys.readouterr().err
    )


def test_chat_puts_the_prompt_in_the_chat_template_with_one_bos(llm, tmp_path, capsys):
    """``--chat``: the prompt is the user's message in the tokenizer's chat template, read
    with the template's one BOS (the tokenizer adds it; the template writes it too), as
    ``apply_chat_template`` tokenizes it; the template's text pasted in a file is read the
    same way, not with two BOS tokens; a tokenizer without a template, or a classifier, is
    refused in one line."""
    import json
    import shutil

    from lm_models import WORDS

    folder = tmp_path / "instruct"
    shutil.copytree(llm, folder)
    tokenizer = make_word_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    chat, pasted = tmp_path / "chat.json", tmp_path / "pasted.json"
    args = ["--model", str(folder), "--target", "seven", "--methods", "grad_sam", "--raw"]
    assert main(["explain", *args, PROMPT, "--chat", "--json", str(chat)]) == 0
    template = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    assert template.startswith("<s>question")
    prompt_file = tmp_path / "template.txt"
    prompt_file.write_text(template, encoding="utf-8")
    assert main(["explain", *args, "--file", str(prompt_file), "--json", str(pasted)]) == 0

    ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
    assert ids[0, :2].tolist() == [1, WORDS.index("question")], "one BOS"
    answer = torch.tensor([[WORDS.index("seven")]])
    expected = GradSAM(make_decoder("llama")).attribute_span(ids, answer, additional_forward_args=(torch.ones_like(ids),))
    for path in (chat, pasted):
        written = json.loads(path.read_text(encoding="utf-8"))
        assert written["prompt_tokens"] == tokenizer.convert_ids_to_tokens(ids[0].tolist())
        torch.testing.assert_close(torch.tensor(written["seq_attr"]["Grad-SAM"]), expected[0, : ids.shape[1]], rtol=1e-4, atol=1e-8)
    template = [token in ("<s>", "question", "answer") for token in written["prompt_tokens"]]
    assert json.loads(chat.read_text(encoding="utf-8"))["template"] == template and written["template"] == []
    in_chat, as_pasted = capsys.readouterr().out.split("prompt: ")[1:]
    assert "the chat template's 3 tokens left out" in in_chat and "the chat template's" not in as_pasted
    top = in_chat.splitlines()[-2]  # Grad-SAM's top tokens, the template's not among them
    assert top.startswith("  ") and not any(f" {token} " in f" {top} " for token in ("question", "answer"))
    estimates = tmp_path / "estimates.json"
    assert main(["explain", *args[:4], "--methods", "leave_one_out_estimates", PROMPT, "--chat", "--json", str(estimates)]) == 0
    scores = json.loads(estimates.read_text(encoding="utf-8"))["seq_attr"]["Leave-one-out estimates"]
    assert [score == 0 for score in scores] == template, "the template's tokens are never removed, as evaluate keeps them"
    assert main(["explain", "--model", str(llm), PROMPT, "--chat"]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "the model's tokenizer (" in error and "has no chat template (a base model's): leave --chat out" in error
    assert main(["explain", "the plot was dull", "--chat"]) == 1
    assert "--chat is for a language model's prompt" in capsys.readouterr().err


def test_a_translation_models_languages_are_set_as_its_model_card_sets_them(translation, tmp_path, capsys):
    """NLLB: --source-language is the code the tokenizer puts before the source,
    --target-language the token generate forces first; the scores are the library's with
    both set so by hand, and other than those of the defaults."""
    import json

    from captum.attr import TextTokenInput

    from captum_attention.loading import load_causal_lm

    source = "the cat sat on the mat"
    reports = {name: tmp_path / f"{name}.json" for name in ("set", "defaults", "generated")}
    languages = ["--source-language", "fra_Latn", "--target-language", "deu_Latn"]
    given = ["--target", "the dog", "--methods", "grad_sam"]
    assert main(["explain", "--model", str(translation), source, *languages, *given, "--json", str(reports["set"])]) == 0
    assert main(["explain", "--model", str(translation), source, *given, "--json", str(reports["defaults"])]) == 0
    assert main(["explain", "--model", str(translation), source, *languages, "--max-new-tokens", "3", "--methods", "raw",
                 "--json", str(reports["generated"])]) == 0
    written = {name: json.loads(path.read_text(encoding="utf-8")) for name, path in reports.items()}
    assert written["set"]["prompt_tokens"][0] == "fra_Latn" and written["defaults"]["prompt_tokens"][0] == "eng_Latn"
    assert written["set"]["answer_tokens"] == ["deu_Latn", "the", "dog"]
    assert written["defaults"]["answer_tokens"] == ["the", "dog"]
    assert written["generated"]["answer_tokens"][0] == "deu_Latn"
    assert "'deu_Latn', is the one the model's generate forces there" in capsys.readouterr().err
    model, tokenizer = load_causal_lm(translation, seq2seq=True)
    tokenizer.src_lang = "fra_Latn"
    model.generation_config.forced_bos_token_id = tokenizer.convert_tokens_to_ids("deu_Latn")
    expected = LLMAttentionAttribution(GradSAM(model), tokenizer).attribute(TextTokenInput(source, tokenizer), target="the dog")
    scores = {name: torch.tensor(report["seq_attr"]["Grad-SAM"]) for name, report in written.items() if name != "generated"}
    torch.testing.assert_close(scores["set"], expected.seq_attr.float(), rtol=1e-5, atol=1e-7)
    assert not torch.allclose(scores["set"], scores["defaults"], rtol=1e-3)


def test_a_language_the_model_or_its_tokenizer_cannot_take_is_refused_in_one_line(translation, seq2seq, llm, capsys):
    def refused(folder, *options):
        assert main(["explain", "--model", str(folder), "the cat", *options, "--methods", "raw"]) == 1
        return capsys.readouterr().err.strip()

    assert refused(translation, "--target-language", "deu_latn") == (
        "captum-attention: error: --target-language 'deu_latn' is not a language code of the model's NllbTokenizer "
        "(the closest of its 202: deu_Latn, eus_Latn, dyu_Latn)"
    )
    assert "is not a language code of the model's NllbTokenizer (its 202 codes begin ace_Arab" in refused(
        translation, "--source-language", "german"
    )
    assert refused(seq2seq, "--source-language", "fra_Latn").endswith(
        "--source-language: the model's TokenizersBackend takes no source language (it has no src_lang, as NLLB's, "
        "M2M100's and mBART-50's tokenizers do)"
    )
    assert refused(seq2seq, "--target-language", "fra_Latn").endswith("is not a language code of the model's TokenizersBackend")
    assert refused(llm, "--target-language", "fra_Latn").endswith(
        f"--target-language is for a translation model (a sequence-to-sequence checkpoint); {llm} is not one"
    )
    assert main(["explain", "the cat", "--source-language", "fra_Latn", "--target-language", "deu_Latn"]) == 1
    assert capsys.readouterr().err.strip().endswith("are for a translation model (a sequence-to-sequence checkpoint); the default model is not one")


def test_a_language_code_is_read_as_m2m100s_tokenizer_writes_it():
    """M2M100's tokenizer writes the code "fr" as the token "__fr__" (get_lang_token)."""
    from lm_models import make_translation_model, make_translation_tokenizer

    from captum_attention.loading import set_languages

    tokenizer = make_translation_tokenizer()
    tokenizer.get_lang_token = lambda code: {"de": "deu_Latn", "fr": "fra_Latn"}.get(code, code)
    model = make_translation_model(len(tokenizer))
    set_languages(model, tokenizer, source="fr", target="de")
    assert model.generation_config.forced_bos_token_id == tokenizer.convert_tokens_to_ids("deu_Latn")
    assert tokenizer.src_lang == "fr"
