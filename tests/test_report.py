"""The reports read well: stars on the strongest support, a warning where the tokenizer
knew no word, times without warm-up, readable colours, short headings, hover values in
the terminal's units."""

from __future__ import annotations

import torch
import transformers as tf

from captum_attention.presentation import explain as explain_module
from captum_attention.presentation.explain import Explanations, MethodInfo, SentenceExplanation
from captum_attention.presentation.html import DARK_CELL, TITLE_CHARACTERS, render_html
from captum_attention.presentation.text import render_text

SIGNED = MethodInfo(uses_target=True, signed=True)


def _explanations(scores: list[float], text: str = "a b c d", all_unknown: bool = False) -> Explanations:
    tokens = ["[CLS]", *text.split()[: len(scores) - 2], "[SEP]"]
    sentence = SentenceExplanation(
        text=text, tokens=tokens, label="negative", probability=0.9, target=0, target_label="negative",
        special=[True, *[False] * (len(tokens) - 2), True], scores={"AttnLRP": scores},
        probabilities={"negative": 0.9, "positive": 0.1}, all_unknown=all_unknown,
    )
    return Explanations([sentence], {"AttnLRP": 0.01}, {"AttnLRP": SIGNED})


def test_stars_mark_only_positive_shares_of_a_signed_method():
    table = render_text(_explanations([0.0, -0.008, -0.016, 0.002, -0.5, 0.0]))
    rows = {line.split()[0]: line.split()[1] for line in table.splitlines() if line.startswith("  ") and len(line.split()) == 2}
    assert rows["c"].endswith("*")  # the one positive share
    assert not any(rows[t].endswith("*") for t in ("a", "b", "d"))
    assert "largest positive shares" in table and "exclude one warm-up call" in table


def test_a_sentence_of_unknown_words_is_warned_about_in_both_reports():
    explanations = _explanations([0.0, 0.1, 0.0], text="[UNK]", all_unknown=True)
    assert "every word is unknown to the tokenizer" in render_text(explanations)
    assert "Every word is unknown to the tokenizer" in render_html(explanations, "m")


def test_all_unknown_is_detected_from_the_tokenizer():
    class Tokenizer:  # [PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, film 4
        unk_token_id, all_special_ids = 1, [0, 1, 2, 3]

    assert explain_module._all_unknown([2, 1, 1, 3], Tokenizer())
    assert not explain_module._all_unknown([2, 1, 4, 3], Tokenizer())
    assert not explain_module._all_unknown([2, 3], Tokenizer())


def test_html_headings_are_short_dark_cells_white_and_hover_shows_the_share():
    long_text = " ".join(["word"] * 600)
    page = render_html(_explanations([0.0, 1.0, 0.1, -0.5, 0.0], text=long_text), "m")
    heading = page.split('<h2 class="sentence"><bdi>')[1].split("</bdi>")[0]
    assert len(heading) <= TITLE_CHARACTERS and heading.endswith("…")
    assert DARK_CELL <= 1.0 and page.count("color: #fff") == 1  # the strongest cell only
    assert "share +0.625 of the words (score 1.000e+00)" in page  # 1 / (1 + 0.1 + 0.5)


def test_wall_times_exclude_a_warm_up_call(monkeypatch):
    calls = []

    def fake_batch(model, tokenizer, sentences, target, limit, methods, separator):
        calls.append(len(sentences))
        return [], {}

    monkeypatch.setattr(explain_module, "_explain_batch", fake_batch)
    monkeypatch.setattr(explain_module, "report_methods", lambda *a, **k: {})
    model = tf.BertForSequenceClassification(tf.BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8))
    explain_module.explain(model, None, ["a", "b", "c"], batch_size=2)
    assert calls == [1, 2, 1]  # one sentence untimed first, then the batches
    assert torch.is_grad_enabled()


# A language model's answer ---------------------------------------------------------------

from captum_attention.presentation.answer import AnswerExplanation  # noqa: E402
from captum_attention.presentation.html import LONG_PROMPT, render_answer_html  # noqa: E402

POSITIVE = MethodInfo(uses_target=True, signed=False)


def _answer(rows: list[list[float]], tokens: list[str]) -> AnswerExplanation:
    return AnswerExplanation(
        prompt_tokens=tokens, special=[False] * len(tokens), answer_tokens=[f"a{i}" for i in range(len(rows))],
        answer=" ".join(f"a{i}" for i in range(len(rows))), generated=False,
        seq_attr={"Grad-SAM": [sum(column) for column in zip(*rows)]}, token_attr={"Grad-SAM": rows},
        seconds={"Grad-SAM": 0.01}, methods={"Grad-SAM": POSITIVE},
    )


def _cell_strengths(page: str) -> list[list[float]]:
    import re

    rows = re.findall(r"<tr><th><bdi>a\d+</bdi></th>(.*?)</tr>", page)
    return [[float(s) for s in re.findall(r"rgba\(0, 140, 60, ([0-9.]+)\)", row)] for row in rows]


def test_each_heat_matrix_row_is_coloured_on_its_own_scale_and_says_how_peaked_it_is():
    rows = [[0.01, 0.9, 0.02], [5.0, 0.1, 0.2], [0.33, 0.33, 0.34]]
    page = render_answer_html(_answer(rows, ["x", "y", "z"]), "m")
    strengths = _cell_strengths(page)
    assert strengths[0][1] == 1.0 and strengths[1][0] == 1.0, "every row reaches full colour at its own largest score"
    assert abs(strengths[0][0] - 0.01 / 0.9) < 1e-3 and abs(strengths[1][2] - 0.2 / 5.0) < 1e-3
    assert "peak ×1.0 the mean, near uniform" in page and "peak ×2.9 the mean" in page


def test_a_long_prompt_is_summarised_first_and_folded_around_its_top_tokens():
    count = 4000
    tokens = [f"t{i}" for i in range(count)]
    rows = [[1.0 if i == 2500 else 0.001 * (i % 7) for i in range(count)] for _ in range(8)]
    page = render_answer_html(_answer(rows, tokens), "m")
    assert count > LONG_PROMPT and len(page) < 60_000, len(page)
    assert page.index("<h2>Summary</h2>") < page.index("<section>")
    assert "<bdi>t2500</bdi>&nbsp;" in page.split("<section>")[0], "the top token leads the summary"
    assert "… 2 tokens …" not in page and "tokens …</span>" in page
    assert all(len(row) == 10 for row in _cell_strengths(page)), "each row's top 10 columns"
