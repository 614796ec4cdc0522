"""The command line for vision-language models: ``explain --model DIR --image FILE``, the
answer, each method's prompt tokens (the image's as one) and the image's grid, in the
terminal, the HTML report (the grid over the image) and JSON."""

from __future__ import annotations

import html as html_module
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from vlm_models import (
    IMAGE, save_blip_checkpoint, save_captioner_checkpoint, save_git_checkpoint, save_llava_checkpoint, save_mllama_checkpoint,
    save_gemma3_checkpoint, save_paligemma_checkpoint,
)

from captum_attention import AttnLRP, GradSAM, RawAttention, image_scores
from captum_attention.presentation.cli import main


def _saved(tmp_path_factory, name: str, save) -> object:
    """A checkpoint folder ``name`` the tiny model's ``save`` wrote."""
    folder = tmp_path_factory.mktemp("vlm") / name
    save(folder)
    return folder


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return _saved(tmp_path_factory, "llava", save_llava_checkpoint)


def _image(tmp_path, width=48, height=48):
    path = tmp_path / f"image_{width}x{height}.png"
    Image.fromarray((np.random.default_rng(0).random((height, width, 3)) * 255).astype("uint8")).save(path)
    return path


def test_explain_an_answer_about_an_image(llava, tmp_path, capsys):
    html, report = tmp_path / "answer.html", tmp_path / "answer.json"
    argv = ["explain", "--model", str(llava), "--image", str(_image(tmp_path)), "what is the cat", "--target", "is a",
            "--per-token", "--html", str(html), "--json", str(report)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # five methods and AttnLRP → pixels, the five with a grid per answer token too
    assert "answer, given, 2 tokens:" in out and out.count("image: peak at row") == 6 + 5 * 2
    assert out.count(" <- ") == 2 * 6
    page = html.read_text(encoding="utf-8")
    assert page.count("data:image/png;base64,") == 6 + 5 * 2 and page.count("4 × 4 grid over the image, the whole answer.</figcaption>") == 6
    assert page.count("Each answer token's grid over the image") == 5
    explanation = json.loads(report.read_text(encoding="utf-8"))
    assert explanation["prompt_tokens"] == ["<s>", "<image>", "what", "is", "the", "cat"]
    assert explanation["grid_covers_image"] is True


def test_prompt_words_the_tokenizer_does_not_know_are_warned_about(llava, tmp_path, capsys):
    argv = ["explain", "--model", str(llava), "--image", str(_image(tmp_path)), "what is the zebra", "--target", "is a",
            "--methods", "raw"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    # counted as the report shows the prompt, the image's 16 tokens as one
    assert "warning: the tokenizer read 1 of the prompt's 6 tokens as" in captured.err
    assert "prompt: 6 tokens" in captured.out


def test_the_report_holds_the_methods_scores_of_the_image_tokens(llava, tmp_path, capsys):
    """The JSON's grid and the <image> token's score are the span's, through the processor;
    each answer token's grid the continuation's row's."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    image, report = _image(tmp_path), tmp_path / "answer.json"
    assert main(["explain", "--model", str(llava), "--image", str(image), "what is the cat", "--target", "is a",
                 "--methods", "grad_sam", "--per-token", "--json", str(report)]) == 0
    explanation = json.loads(report.read_text(encoding="utf-8"))
    model = AutoModelForImageTextToText.from_pretrained(llava, local_files_only=True).eval()
    processor = AutoProcessor.from_pretrained(llava, local_files_only=True)
    inputs = dict(processor(text="<image> what is the cat", images=Image.open(image).convert("RGB"), return_tensors="pt"))
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    answer = torch.tensor([processor.tokenizer("is a", add_special_tokens=False)["input_ids"]])
    span = GradSAM(model).attribute_span(ids, answer, additional_forward_args=(mask, inputs))[:, : ids.shape[1]]
    (grid,) = image_scores(model, ids, span, inputs)[0]
    torch.testing.assert_close(torch.tensor(explanation["image_grids"]["Grad-SAM"]), grid)
    image_score = explanation["seq_attr"]["Grad-SAM"][explanation["prompt_tokens"].index("<image>")]
    torch.testing.assert_close(torch.tensor(image_score), span[0, ids[0] == IMAGE].sum())
    rows = GradSAM(model).attribute_continuation(ids, answer, additional_forward_args=(mask, inputs), log_prob=True)
    (token_grids,) = image_scores(model, ids, rows, inputs)[0]
    assert token_grids.shape == (2, *grid.shape)
    torch.testing.assert_close(torch.tensor(explanation["token_grids"]["Grad-SAM"]), token_grids)


def test_attn_lrp_through_the_vision_tower_is_reported_against_a_grey_image(llava, tmp_path, capsys):
    """The report's ``AttnLRP → pixels``: the span through the tower against the processor's
    grey image of the same size, its pixels summed per patch and as the <image> token's score."""
    import torch.nn.functional as F
    from transformers import AutoModelForImageTextToText, AutoProcessor

    image, report = _image(tmp_path), tmp_path / "answer.json"
    assert main(["explain", "--model", str(llava), "--image", str(image), "what is the cat", "--target", "is",
                 "--methods", "attn_lrp", "--json", str(report)]) == 0
    explanation = json.loads(report.read_text(encoding="utf-8"))
    assert list(explanation["seq_attr"]) == ["AttnLRP", "AttnLRP → pixels"]
    model = AutoModelForImageTextToText.from_pretrained(llava, local_files_only=True).eval()
    processor = AutoProcessor.from_pretrained(llava, local_files_only=True)
    picture = Image.open(image).convert("RGB")
    inputs = dict(processor(text="<image> what is the cat", images=picture, return_tensors="pt"))
    grey = processor(text="<image> what is the cat", images=Image.new("RGB", picture.size, (128, 128, 128)), return_tensors="pt")
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    tokens, pixels = AttnLRP(model).attribute_span(
        ids, torch.tensor([[26]]), additional_forward_args=(mask, inputs), through_vision_tower=True, pixel_baselines=grey["pixel_values"]
    )
    patches = F.avg_pool2d(pixels.sum(dim=1, keepdim=True), 8)[0, 0] * 64
    torch.testing.assert_close(torch.tensor(explanation["image_grids"]["AttnLRP → pixels"]), patches)
    scores = explanation["seq_attr"]["AttnLRP → pixels"]
    torch.testing.assert_close(torch.tensor(scores[explanation["prompt_tokens"].index("<image>")]), pixels.sum())
    torch.testing.assert_close(torch.tensor(scores[explanation["prompt_tokens"].index("cat")]), tokens[0, ids.shape[1] - 1])


def test_the_grey_image_itself_is_told_to_score_0_against_itself(llava, tmp_path, capsys):
    """Its pixels' scores, measured against the grey image, are 0: the report said "every
    cell scores 0" with no word of why."""
    grey, other = tmp_path / "grey.png", _image(tmp_path)
    Image.new("RGB", (48, 48), (128, 128, 128)).save(grey)
    warning = "warning: the image is the uniform grey image its pixels' scores are measured against: they are 0 everywhere"
    for image, warned in ((grey, True), (other, False)):
        assert main(["explain", "--model", str(llava), "--image", str(image), "what is the cat", "--target", "is",
                     "--methods", "attn_lrp"]) == 0
        assert (warning in capsys.readouterr().err) == warned


def test_a_grid_the_image_does_not_follow_is_shown_alone(llava, tmp_path, capsys):
    """CLIP's processor crops a wide image to its centre: the grid is not laid over it."""
    html = tmp_path / "wide.html"
    assert main(["explain", "--model", str(llava), "--image", str(_image(tmp_path, 96, 48)), "what is the cat",
                 "--target", "is", "--methods", "attn_lrp", "--html", str(html)]) == 0
    page = html.read_text(encoding="utf-8")
    assert "not laid over the image" in page and page.count("data:image/png;base64,") == 2  # AttnLRP, → pixels


def test_clear_errors(llava, tmp_path, capsys, llm):
    image = _image(tmp_path)
    assert main(["explain", "--model", str(llava), "what is the cat"]) == 1
    assert "give the image with --image" in capsys.readouterr().err
    assert main(["explain", "--model", str(llava), "--image", str(tmp_path / "missing.png"), "what"]) == 1
    assert "no such file" in capsys.readouterr().err
    assert main(["explain", "--model", str(llava), "--image", str(image), "what", "--methods", "attn_lrp_presence"]) == 1
    refusal = capsys.readouterr().err
    assert "attn_lrp_presence is not available for vision-language models" in refusal
    assert "grad_sam" in refusal and "integrated_gradients" in refusal and "attention_flow" not in refusal  # what explains a whole answer
    for method in ("attn_lrp_presence_calibrated", "attn_lrp_half_contexts"):
        assert main(["explain", "--model", str(llava), "--image", str(image), "what", "--methods", method]) == 1
        assert f"{method} is not available for vision-language models" in capsys.readouterr().err
    assert main(["explain", "--model", str(llm), "--image", str(image), "what"]) == 1
    assert "--image is for an image classifier or a vision-language model; " in capsys.readouterr().err


def test_a_family_of_unknown_layout_shows_the_images_summed_score_without_a_grid(llava, tmp_path, capsys, monkeypatch):
    from captum_attention.capture.adapters import images

    monkeypatch.delitem(images._LAYOUTS, "llava")
    report, html = tmp_path / "answer.json", tmp_path / "answer.html"
    assert main(["explain", "--model", str(llava), "--image", str(_image(tmp_path)), "what is the cat", "--target", "is",
                 "--methods", "raw", "--json", str(report), "--html", str(html)]) == 0
    captured = capsys.readouterr()
    assert "the layout of llava's image tokens is not known" in captured.err and "image: peak" not in captured.out
    explanation = json.loads(report.read_text(encoding="utf-8"))
    assert explanation["image_grids"] == {} and "<image>" in explanation["prompt_tokens"]
    assert "data:image/png" not in html.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def mllama(tmp_path_factory):
    return _saved(tmp_path_factory, "mllama", save_mllama_checkpoint)


def test_explain_mllamas_answer_its_image_read_by_cross_attention(mllama, tmp_path, capsys):
    """A 20 × 40 image cut in two tiles: the grid is the tiles' 2 × 4 patches, the <image>
    feature the image states' summed score beside its token's own; Grad-SAM, whose scores
    follow queries, gives the states none and says so."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from captum_attention import TransformerAttribution

    image, report, html = _image(tmp_path, 40, 20), tmp_path / "answer.json", tmp_path / "answer.html"
    assert main(["explain", "--model", str(mllama), "--image", str(image), "what is the cat", "--target", "is a",
                 "--methods", "grad_sam,transformer_attribution,attn_lrp", "--json", str(report), "--html", str(html)]) == 0
    out = capsys.readouterr().out
    assert "image: every cell of its 2 × 4 grid scores 0" in out and out.count("image: peak at row") == 2
    explanation = json.loads(report.read_text(encoding="utf-8"))
    assert list(explanation["seq_attr"]) == ["Grad-SAM", "Transformer Attribution", "AttnLRP"], "no AttnLRP → pixels"
    model = AutoModelForImageTextToText.from_pretrained(mllama, local_files_only=True).eval()
    processor = AutoProcessor.from_pretrained(mllama, local_files_only=True)
    inputs = dict(processor(text="<|image|> what is the cat", images=Image.open(image).convert("RGB"), return_tensors="pt"))
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    states, text = TransformerAttribution(model).attribute_span(ids, torch.tensor([[26, 4]]), additional_forward_args=(mask, inputs))  # "is a"
    (grid,) = image_scores(model, ids, (states, text), inputs)[0]
    torch.testing.assert_close(torch.tensor(explanation["image_grids"]["Transformer Attribution"]), grid)
    image_score = explanation["seq_attr"]["Transformer Attribution"][explanation["prompt_tokens"].index("<image>")]
    torch.testing.assert_close(torch.tensor(image_score), text[0, : ids.shape[1]][ids[0] == IMAGE].sum() + states.sum())
    page = html.read_text(encoding="utf-8")
    assert page.count("data:image/png;base64,") == 2 and "grid scores 0 under this method" in page


def test_a_registered_method_outside_the_defaults_on_request(llava, mllama, tmp_path, capsys):
    """``--methods`` takes any registered method for LLaVA, its image's grid included (ALTI's
    grid is :func:`image_scores` of its span scores); Mllama, which cross-attends to the
    image's states, refuses the one-stack methods in one line before any work."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from captum_attention import ALTI

    image, report = _image(tmp_path), tmp_path / "answer.json"
    assert main(["explain", "--model", str(llava), "--image", str(image), "what is the cat", "--target", "cat",
                 "--methods", "alti,knockout_lrp", "--json", str(report)]) == 0
    explanation = json.loads(report.read_text(encoding="utf-8"))
    assert list(explanation["seq_attr"]) == list(explanation["image_grids"]) == ["ALTI", "Knockout Gradient + AttnLRP"]
    model = AutoModelForImageTextToText.from_pretrained(llava, local_files_only=True).eval()
    processor = AutoProcessor.from_pretrained(llava, local_files_only=True)
    inputs = dict(processor(text=f"{processor.image_token} what is the cat", images=Image.open(image).convert("RGB"), return_tensors="pt"))
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    answer = torch.tensor([processor.tokenizer("cat", add_special_tokens=False)["input_ids"]])
    span = ALTI(model).attribute_span(ids, answer, additional_forward_args=(mask, inputs))
    torch.testing.assert_close(torch.tensor(explanation["image_grids"]["ALTI"]), image_scores(model, ids, span, inputs)[0][0])
    capsys.readouterr()
    assert main(["explain", "--model", str(mllama), "--image", str(image), "what", "--methods", "attn_lrp,alti"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "alti explains one self-attention stack" in captured.err


def _instruct(llava, tmp_path):
    """The tiny LLaVA with a chat template: ``<s>question <image> {prompt} answer``."""
    import shutil

    from transformers import AutoProcessor

    folder = tmp_path / "instruct"
    shutil.copytree(llava, folder)
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    processor.chat_template = (
        "<s>{% for message in messages %}question {% for item in message['content'] %}{% if item['type'] == 'image' %}"
        "<image> {% else %}{{ item['text'] }}{% endif %}{% endfor %} {% endfor %}{% if add_generation_prompt %}answer{% endif %}"
    )
    processor.save_pretrained(folder)
    return folder, processor


def test_chat_puts_the_image_and_the_prompt_in_the_processors_chat_template(llava, tmp_path, capsys):
    """``--chat`` with ``--image``: the image and the prompt are the user's turn in the
    processor's chat template, read with the template's one BOS; a processor without a
    template is refused in one line."""
    from transformers import AutoModelForImageTextToText

    folder, processor = _instruct(llava, tmp_path)
    image, report = _image(tmp_path), tmp_path / "answer.json"
    assert main(["explain", "--model", str(folder), "--image", str(image), "what is the cat", "--target", "is", "--chat",
                 "--methods", "grad_sam", "--json", str(report)]) == 0
    explanation = json.loads(report.read_text(encoding="utf-8"))
    assert explanation["prompt_tokens"] == ["<s>", "question", "<image>", "what", "is", "the", "cat", "answer"]
    assert explanation["template"] == [True, True, False, False, False, False, False, True], "the user's image and text"
    model = AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True).eval()
    inputs = dict(processor(text="question <image> what is the cat answer", images=Image.open(image).convert("RGB"),
                            return_tensors="pt"))
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    assert (ids[0, :2] == torch.tensor([1, 1])).sum() == 1, "one BOS"
    span = GradSAM(model).attribute_span(ids, torch.tensor([[26]]), additional_forward_args=(mask, inputs))[:, : ids.shape[1]]
    text_scores = [s for s, token in zip(explanation["seq_attr"]["Grad-SAM"], explanation["prompt_tokens"]) if token != "<image>"]
    torch.testing.assert_close(torch.tensor(text_scores), span[0, ids[0] != IMAGE])
    capsys.readouterr()
    assert main(["explain", "--model", str(llava), "--image", str(image), "what is the cat", "--chat"]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "the model's processor (LlavaProcessor) has no chat template" in error


def _alone_log_prob(model, ids, inputs, answer, columns) -> float:
    """log p(answer | the prompt's tokens at ``columns``), the model run on them alone with
    the image inputs."""
    sequence = torch.cat([ids[:, columns], answer], dim=1)
    with torch.no_grad():
        logits = model(input_ids=sequence, attention_mask=torch.ones_like(sequence), **inputs).logits
    return float(logits[0, -answer.shape[1] - 1 : -1].log_softmax(-1).gather(1, answer[0][:, None]).sum())


def test_the_leave_one_out_estimates_explain_an_answer_about_an_image(llava, tmp_path, capsys):
    """``--methods leave_one_out_estimates`` with ``--image --chat``: KnockoutGradient's
    first-order effects, the two words AttnLRP ranks highest deleted exactly, the image and
    the template's tokens never removed (the <image> token scores 0, with a warning, and
    has no grid)."""
    from transformers import AutoModelForImageTextToText

    from captum_attention import KnockoutGradient

    folder, processor = _instruct(llava, tmp_path)
    image, report = _image(tmp_path), tmp_path / "answer.json"
    assert main(["explain", "--model", str(folder), "--image", str(image), "what is the cat", "--target", "is a", "--chat",
                 "--methods", "leave_one_out_estimates", "--json", str(report)]) == 0
    assert "the leave-one-out estimates never remove the image" in capsys.readouterr().err
    explanation = json.loads(report.read_text(encoding="utf-8"))
    assert explanation["prompt_tokens"] == ["<s>", "question", "<image>", "what", "is", "the", "cat", "answer"]
    assert explanation["image_grids"] == {}
    model = AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True).eval()
    inputs = dict(processor(text="question <image> what is the cat answer", images=Image.open(image).convert("RGB"),
                            return_tensors="pt"))
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    answer = torch.tensor([processor.tokenizer("is a", add_special_tokens=False)["input_ids"]])
    words = [i for i, token in enumerate(ids[0].tolist()) if token in processor.tokenizer.convert_tokens_to_ids(["what", "is", "the", "cat"])]
    assert len(words) == 4

    def span(method) -> torch.Tensor:
        return method.attribute_span(ids, answer, additional_forward_args=(mask, inputs))[0, : ids.shape[1]].detach()

    expected = torch.zeros(ids.shape[1])
    expected[words] = span(KnockoutGradient(model))[words]
    relevance = span(AttnLRP(model))
    for deleted in sorted(words, key=lambda i: -float(relevance[i].abs()))[:2]:
        expected[deleted] = _drop_alone(model, ids, inputs, answer, [i for i in range(ids.shape[1]) if i != deleted])
    text_scores = [s for s, token in zip(explanation["seq_attr"]["Leave-one-out estimates"], explanation["prompt_tokens"]) if token != "<image>"]
    torch.testing.assert_close(torch.tensor(text_scores), expected[ids[0] != IMAGE], rtol=1e-4, atol=1e-5)
    assert explanation["seq_attr"]["Leave-one-out estimates"][2] == 0.0


def test_integrated_gradients_explain_and_evaluate_an_answer_about_an_image_with_the_image_held(llava, tmp_path, capsys):
    """``--methods integrated_gradients`` with ``--image``: the words' scores are
    ``answer_integrated_gradients`` with the processor's image inputs (checked against
    autograd in ``test_vlm_answers.py``); the grid and the <image> token's score are
    Integrated Gradients on the pixels against the grey image, the prompt held (Captum's,
    by hand; they were no grid and 0), with a warning saying both; ``evaluate`` gives the
    same word scores' metrics for a row about that image."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from captum_attention.presentation.explain import answer_integrated_gradients

    image, report, out = _image(tmp_path), tmp_path / "answer.json", tmp_path / "out"
    assert main(["explain", "--model", str(llava), "--image", str(image), "what is the cat", "--target", "is a",
                 "--methods", "integrated_gradients", "--ig-steps", "4", "--json", str(report)]) == 0
    assert "and the image's patches over the pixels against a grey image with the prompt held" in capsys.readouterr().err
    explanation = json.loads(report.read_text(encoding="utf-8"))
    model = AutoModelForImageTextToText.from_pretrained(llava, local_files_only=True).eval()
    processor = AutoProcessor.from_pretrained(llava, local_files_only=True)
    inputs = dict(processor(text="<image> what is the cat", images=Image.open(image).convert("RGB"), return_tensors="pt"))
    ids, _ = inputs.pop("input_ids"), inputs.pop("attention_mask")
    answer = torch.tensor([processor.tokenizer("is a", add_special_tokens=False)["input_ids"]])
    expected = answer_integrated_gradients(model, ids, answer, 4, inputs)
    scores, shown = explanation["seq_attr"]["Integrated Gradients"], explanation["prompt_tokens"]
    grey = processor(text="<image>", images=Image.new("RGB", Image.open(image).size, (128, 128, 128)), return_tensors="pt")["pixel_values"]
    grid = _pixel_integrated_gradients(model, ids, inputs["pixel_values"], grey, answer, steps=4)
    assert grid.abs().sum() > 1e-3, "the pixels move the answer"
    torch.testing.assert_close(torch.tensor(explanation["image_grids"]["Integrated Gradients"]), grid, rtol=1e-4, atol=1e-6)
    assert scores[shown.index("<image>")] == pytest.approx(float(grid.sum()), rel=1e-4, abs=1e-6)
    words = [score for score, token in zip(scores, shown) if token != "<image>"]
    torch.testing.assert_close(torch.tensor(words), expected[0, ids[0] != IMAGE], rtol=1e-4, atol=1e-6)
    data = _answers(tmp_path, [{"prompt": "what is the cat", "image": image.name, "answer": "is a"}])
    assert main(["evaluate", str(data), "--model", str(llava), "--methods", "integrated_gradients", "--ig-steps", "4",
                 "--output", str(out)]) == 0
    row = json.loads((out / "results.jsonl").read_text().splitlines()[0])
    text = [i for i in range(1, ids.shape[1]) if int(ids[0, i]) != IMAGE]  # BOS and the image's tokens stay
    removed = sorted(text, key=lambda i: (-float(expected[0, i]), i))[:3]
    kept = [i for i in range(ids.shape[1]) if i not in removed]
    assert row["top_k_log_prob_drop"] == pytest.approx(_drop_alone(model, ids, inputs, answer, kept), abs=1e-4)


def _drop_alone(model, ids, inputs, answer, kept) -> float:
    """How far log p(answer) falls from the whole prompt to its tokens at ``kept``."""
    return _alone_log_prob(model, ids, inputs, answer, list(range(ids.shape[1]))) - _alone_log_prob(model, ids, inputs, answer, kept)


def _answers(tmp_path, rows):
    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return data


def test_evaluate_scores_answers_about_images_as_the_metrics_do_directly(llava, tmp_path):
    """Each row's answer about its image: Grad-SAM's span, and its top-3 drop against the
    model run without the three highest-scored text tokens (the image's never removed)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from captum_attention.metrics import linear_datamodeling_score

    _image(tmp_path)
    rows = [{"prompt": "what is the cat", "image": "image_48x48.png", "answer": "is a"},
            {"prompt": "<image> the cat is what", "image": str(_image(tmp_path, 64, 48))}]
    out = tmp_path / "out"
    assert main(["evaluate", str(_answers(tmp_path, rows)), "--model", str(llava), "--methods", "grad_sam,attn_lrp",
                 "--max-new-tokens", "2", "--output", str(out)]) == 0
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [(r["index"], r["method"], r["generated"]) for r in results] == [
        (0, "grad_sam", False), (0, "attn_lrp", False), (1, "grad_sam", True), (1, "attn_lrp", True)]
    model = AutoModelForImageTextToText.from_pretrained(llava, local_files_only=True).eval()
    processor = AutoProcessor.from_pretrained(llava, local_files_only=True)
    inputs = dict(processor(text="<image> what is the cat", images=Image.open(tmp_path / "image_48x48.png").convert("RGB"), return_tensors="pt"))
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    answer = torch.tensor([processor.tokenizer("is a", add_special_tokens=False)["input_ids"]])
    span = GradSAM(model).attribute_span(ids, answer, additional_forward_args=(mask, inputs))[0, : ids.shape[1]]
    text = [i for i in range(1, ids.shape[1]) if int(ids[0, i]) != IMAGE]  # BOS and the image's tokens stay
    removed = sorted(text, key=lambda i: (-float(span[i]), i))[:3]
    kept = [i for i in range(ids.shape[1]) if i not in removed]

    whole = list(range(ids.shape[1]))
    assert results[0]["answer_log_prob"] == pytest.approx(_alone_log_prob(model, ids, inputs, answer, whole), abs=1e-5)
    assert results[0]["top_k_log_prob_drop"] == pytest.approx(_drop_alone(model, ids, inputs, answer, kept), abs=1e-4)
    segments = torch.arange(ids.shape[1])[None].masked_fill(torch.arange(ids.shape[1]) == 0, -1)
    lds = linear_datamodeling_score(model, ids, mask, answer, span[None], segments, per_example=True, image_inputs=inputs)
    assert results[0]["lds"] == pytest.approx(float(lds[0]), abs=1e-6)


def test_evaluate_scores_answers_about_images_over_the_images_patches_too(llava, tmp_path):
    """A vision-language model's rows get each patch metric over the image as well
    (``image_`` before its name): AttnLRP's image tokens on their grid and Integrated
    Gradients on the pixels (Captum's, by hand), the top-3 drop against the model run by
    hand on the image with those patches greyed (the processor's grey image's pixels), the
    LDS and leave-one-out agreement the patch metrics' called with the prompt; the
    estimates, which never remove the image, have none; the summary gives each its
    direction."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from captum_attention.metrics import patch_datamodeling_score, patch_leave_one_out_agreement

    image, out = _image(tmp_path), tmp_path / "out"
    data = _answers(tmp_path, [{"prompt": "what is the cat", "image": image.name, "answer": "is a"}])
    assert main(["evaluate", str(data), "--model", str(llava), "--methods", "attn_lrp,integrated_gradients,leave_one_out_estimates",
                 "--ig-steps", "4", "--output", str(out)]) == 0
    rows = {row["method"]: row for row in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    model = AutoModelForImageTextToText.from_pretrained(llava, local_files_only=True).eval()
    processor = AutoProcessor.from_pretrained(llava, local_files_only=True)
    rgb = Image.open(image).convert("RGB")
    inputs = dict(processor(text="<image> what is the cat", images=rgb, return_tensors="pt"))
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    answer = torch.tensor([processor.tokenizer("is a", add_special_tokens=False)["input_ids"]])
    pixels = inputs["pixel_values"]
    grey = processor(text="<image>", images=Image.new("RGB", rgb.size, (128, 128, 128)), return_tensors="pt")["pixel_values"]
    (lrp,) = image_scores(model, ids, AttnLRP(model).attribute_span(ids, answer, additional_forward_args=(mask, inputs)), inputs)[0]
    grids = {"attn_lrp": lrp.detach(), "integrated_gradients": _pixel_integrated_gradients(model, ids, pixels, grey, answer, steps=4)}
    for method, grid in grids.items():
        greyed = _top_patches_greyed(pixels, grey, grid, 3)
        with torch.no_grad():
            drop = float(_pixels_log_prob(model, ids, pixels, answer) - _pixels_log_prob(model, ids, greyed, answer))
        assert abs(drop) > 1e-3, "the image moves the answer"
        row, scores = rows[method], grid[None]
        assert row["image_top_k_log_prob_drop"] == pytest.approx(drop, abs=1e-4), method
        lds = patch_datamodeling_score(model, pixels, answer, scores, grey, per_example=True, prompt_ids=ids)
        assert row["image_lds"] == pytest.approx(float(lds[0]), abs=1e-6), method
        agreement = patch_leave_one_out_agreement(model, pixels, answer, scores, grey, prompt_ids=ids)
        assert row["image_loo_agreement"] == pytest.approx(float(agreement[0]), abs=1e-6), method
    estimates = rows["leave_one_out_estimates"]
    assert [estimates[f"image_{metric}"] for metric in ("top_k_log_prob_drop", "lds", "loo_agreement")] == [None] * 3
    assert "| method | top_k_log_prob_drop ↑ | lds ↑ | loo_agreement ↑ | image_top_k_log_prob_drop ↑ | image_lds ↑ | image_loo_agreement ↑ |" in (
        out / "summary.md").read_text()


def _token_typed_answer(tmp_path, save, image_token: str, answer_types) -> SimpleNamespace:
    """One answer about an image of the checkpoint ``save`` writes, whose processor gives
    token types: ``evaluate``'s rows by method (raw attention, Integrated Gradients in 2
    steps) and the same read by hand: the processor's inputs of ``image_token`` and the
    prompt, the token types over prompt and answer (``answer_types(types, answer)``: the
    answer's as its ``generate`` extends them), the grey image, raw attention's image grid
    and Captum's Integrated Gradients per patch, which ``explain``'s equals."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    folder, image, out, report = tmp_path / "model", _image(tmp_path), tmp_path / "out", tmp_path / "answer.json"
    save(folder)
    data = _answers(tmp_path, [{"prompt": "what is the cat", "image": image.name, "answer": "is a"}])
    assert main(["evaluate", str(data), "--model", str(folder), "--methods", "raw,integrated_gradients", "--ig-steps", "2",
                 "--output", str(out)]) == 0
    assert main(["explain", "--model", str(folder), "--image", str(image), "what is the cat", "--target", "is a",
                 "--methods", "integrated_gradients", "--ig-steps", "2", "--json", str(report)]) == 0
    model = AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True).eval()
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    rgb = Image.open(image).convert("RGB")
    inputs = dict(processor(text=f"{image_token} what is the cat", images=rgb, return_tensors="pt"))
    ids, types, pixels = inputs["input_ids"], inputs["token_type_ids"], inputs["pixel_values"]
    answer = torch.tensor([processor.tokenizer("is a", add_special_tokens=False)["input_ids"]])
    read = torch.cat([types, answer_types(types, answer)], dim=1)
    grey = processor(text=image_token, images=Image.new("RGB", rgb.size, (128, 128, 128)), return_tensors="pt")["pixel_values"]
    image_inputs = {"pixel_values": pixels, "token_type_ids": types}
    span = RawAttention(model).attribute_span(ids, answer, additional_forward_args=(inputs["attention_mask"], image_inputs))
    (raw,) = image_scores(model, ids, span, image_inputs)[0]
    patches = _pixel_integrated_gradients(model, ids, pixels, grey, answer, steps=2, token_type_ids=read)
    assert patches.abs().sum() > 1e-3, "the pixels move the answer"
    torch.testing.assert_close(torch.tensor(json.loads(report.read_text())["image_grids"]["Integrated Gradients"]), patches,
                               rtol=1e-4, atol=1e-6)
    rows = {row["method"]: row for row in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    return SimpleNamespace(rows=rows, model=model, ids=ids, types=types, pixels=pixels, grey=grey, answer=answer, read=read,
                           raw=raw, patches=patches)


def _check_top_3_drops(run: SimpleNamespace, grids: dict[str, torch.Tensor]) -> None:
    """The row's log-probability and each method's top-3 drop against the model run by hand
    with the token types over prompt and answer, on the image with those cells greyed."""
    with torch.no_grad():
        whole = float(_pixels_log_prob(run.model, run.ids, run.pixels, run.answer, run.read))
    assert run.rows["raw"]["answer_log_prob"] == pytest.approx(whole, abs=1e-5)
    for method, grid in grids.items():
        greyed = _top_patches_greyed(run.pixels, run.grey, grid, 3)
        with torch.no_grad():
            drop = whole - float(_pixels_log_prob(run.model, run.ids, greyed, run.answer, run.read))
        assert abs(drop) > 1e-3, "the image moves the answer"
        assert run.rows[method]["image_top_k_log_prob_drop"] == pytest.approx(drop, abs=1e-4), method


def test_paligemmas_answers_are_scored_over_the_images_patches_with_its_token_types(tmp_path):
    """PaliGemma reads its prompt both ways (``token_type_ids`` 0, from its processor) and
    its answer causally (1, as its ``generate`` extends them): ``evaluate``'s image columns
    and ``explain``'s Integrated Gradients on the pixels read the answer so (the model run
    by hand with those token types on the greyed image, Captum's Integrated Gradients by
    hand); they were empty and no grid."""
    run = _token_typed_answer(tmp_path, save_paligemma_checkpoint, "<image>", lambda types, answer: torch.ones_like(answer))
    with torch.no_grad():
        with_types = _pixels_log_prob(run.model, run.ids, run.pixels, run.answer, run.read)
        assert abs(float(with_types - _pixels_log_prob(run.model, run.ids, run.pixels, run.answer))) > 1e-3, "the types matter"
    _check_top_3_drops(run, {"raw": run.raw, "integrated_gradients": run.patches})
    for method in ("raw", "integrated_gradients"):
        assert run.rows[method]["image_lds"] is not None and run.rows[method]["image_loo_agreement"] is not None, method


def test_gemma3s_image_metrics_score_every_method_over_its_pooled_image_tokens(tmp_path):
    """Gemma 3 pools its 4 × 4 patches into 2 × 2 image tokens, which it reads both ways
    (``token_type_ids`` 1): ``explain`` gives Integrated Gradients' grid per patch (Captum's
    by hand), and ``evaluate``'s image columns score it summed over each token's patches, on
    the same 2 × 2 regions as raw attention's tokens (each method's top-3 drop against the
    model run by hand, with the token types as its ``generate`` extends them, on the image
    with those regions greyed). Integrated Gradients' was scored over its 16 patches."""
    from captum_attention.metrics import patch_datamodeling_score

    run = _token_typed_answer(tmp_path, save_gemma3_checkpoint, "<boi>", lambda types, answer: types[:, -1:].expand_as(answer))
    assert int(run.types.sum()) == 4, "the image's 4 tokens"
    grids = {"raw": run.raw, "integrated_gradients": run.patches.reshape(2, 2, 2, 2).sum(dim=(1, 3))}  # each token's 2 × 2 patches
    assert grids["raw"].shape == grids["integrated_gradients"].shape == (2, 2)
    _check_top_3_drops(run, grids)
    for method, grid in grids.items():
        lds = patch_datamodeling_score(run.model, run.pixels, run.answer, grid[None], run.grey, per_example=True, prompt_ids=run.ids,
                                       prompt_inputs={"token_type_ids": run.types})
        assert run.rows[method]["image_lds"] == pytest.approx(float(lds[0]), abs=1e-6), method


def test_evaluate_resumes_the_same_images_only(llava, tmp_path, capsys):
    rows = [{"prompt": "what is the cat", "image": _image(tmp_path).name, "answer": "is a"}]
    data, out = _answers(tmp_path, rows), tmp_path / "out"
    command = ["evaluate", str(data), "--model", str(llava), "--methods", "raw", "--metrics", "top_k_log_prob_drop", "--output", str(out)]
    assert main(command) == 0
    first = (out / "results.jsonl").read_bytes()
    assert main(command) == 0
    assert "resuming: 1 of 1 answers already done" in capsys.readouterr().out
    assert (out / "results.jsonl").read_bytes() == first
    Image.fromarray(np.zeros((48, 48, 3), dtype="uint8")).save(tmp_path / "image_48x48.png")  # another picture, the same file
    assert main(command) != 0
    assert "holds another run (data:" in capsys.readouterr().err


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "what is the cat"}], "every row needs an 'image' (line 1 has none)"),
    ([{"prompt": "what is the cat", "image": "missing.png"}], "'image' missing.png: no such file"),
    ([{"prompt": "what is the cat", "image": "answers.jsonl"}], "'image' answers.jsonl: not an image PIL reads"),
])
def test_evaluate_refuses_rows_a_vision_language_model_cannot_read_in_one_line(llava, tmp_path, capsys, rows, message):
    _image(tmp_path)
    assert main(["evaluate", str(_answers(tmp_path, rows)), "--model", str(llava), "--output", str(tmp_path / "out")]) != 0
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


def test_evaluate_refuses_presence_and_chat_without_a_template_for_a_vision_language_model(llava, tmp_path, capsys):
    data = _answers(tmp_path, [{"prompt": "what is the cat", "image": _image(tmp_path).name}])
    for extra, message in ((["--chat"], "the model's processor (LlavaProcessor) has no chat template"),
                           (["--methods", "attn_lrp_presence"], "attn_lrp_presence is not available for vision-language models")):
        assert main(["evaluate", str(data), "--model", str(llava), "--output", str(tmp_path / "out"), *extra]) != 0
        error = capsys.readouterr().err
        assert message in error and error.count("\n") == 1


def test_evaluate_with_chat_never_removes_the_templates_tokens(llava, tmp_path):
    """``--chat``: the image and the prompt as the user's turn; the top-3 drop removes the
    prompt's own words only, never the template's (``question``, ``answer``)."""
    from transformers import AutoModelForImageTextToText

    folder, processor = _instruct(llava, tmp_path)
    data = _answers(tmp_path, [{"prompt": "what is the cat", "image": _image(tmp_path).name, "answer": "is a"}])
    out = tmp_path / "out"
    assert main(["evaluate", str(data), "--model", str(folder), "--chat", "--methods", "raw", "--metrics", "top_k_log_prob_drop",
                 "--output", str(out)]) == 0
    (row,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    model = AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True).eval()
    inputs = dict(processor(text="question <image> what is the cat answer", images=Image.open(tmp_path / "image_48x48.png").convert("RGB"),
                            return_tensors="pt"))
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    answer = torch.tensor([processor.tokenizer("is a", add_special_tokens=False)["input_ids"]])
    span = RawAttention(model).attribute_span(ids, answer, additional_forward_args=(mask, inputs))[0, : ids.shape[1]]
    words = [i for i, token in enumerate(ids[0].tolist()) if token in processor.tokenizer.convert_tokens_to_ids(["what", "is", "the", "cat"])]
    assert len(words) == 4
    removed = sorted(words, key=lambda i: (-float(span[i]), i))[:3]
    kept = [i for i in range(ids.shape[1]) if i not in removed]

    assert row["top_k_log_prob_drop"] == pytest.approx(_drop_alone(model, ids, inputs, answer, kept), abs=1e-4)


def test_evaluate_removes_a_rows_segments_about_an_image_whole(llava, tmp_path):
    """Segments of the prompt's text (the image's marker inside the first): the top-3 drop
    removes the three segments of highest summed score, each with all its tokens; the
    image's tokens are never removed."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    segments = ["<image> what ", "is the ", "cat ", "is"]
    data = _answers(tmp_path, [{"segments": segments, "image": _image(tmp_path).name, "answer": "a"}])
    out = tmp_path / "out"
    assert main(["evaluate", str(data), "--model", str(llava), "--methods", "grad_sam", "--metrics", "top_k_log_prob_drop",
                 "--output", str(out)]) == 0
    (row,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    model = AutoModelForImageTextToText.from_pretrained(llava, local_files_only=True).eval()
    processor = AutoProcessor.from_pretrained(llava, local_files_only=True)
    inputs = dict(processor(text="".join(segments), images=Image.open(tmp_path / "image_48x48.png").convert("RGB"), return_tensors="pt"))
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask")
    answer = torch.tensor([processor.tokenizer("a", add_special_tokens=False)["input_ids"]])
    span = GradSAM(model).attribute_span(ids, answer, additional_forward_args=(mask, inputs))[0, : ids.shape[1]]
    words = ids.shape[1] - 5  # BOS, the image's tokens, then "what", "is the", "cat", "is": one token a word
    owner = [-1] * words + [0, 1, 1, 2, 3]
    assert int(ids[0, words - 1]) == IMAGE and int(ids[0, words]) != IMAGE
    summed = {s: sum(float(span[i]) for i in range(ids.shape[1]) if owner[i] == s) for s in range(4)}
    removed = sorted(summed, key=lambda s: (-summed[s], s))[:3]
    kept = [i for i in range(ids.shape[1]) if owner[i] not in removed]

    assert row["top_k_log_prob_drop"] == pytest.approx(_drop_alone(model, ids, inputs, answer, kept), abs=1e-4)


def test_segments_a_processor_cannot_place_are_refused_with_the_rows_line(llava, tmp_path, capsys, monkeypatch):
    from captum_attention.presentation import answer

    monkeypatch.setattr(answer, "on_expanded_tokens", lambda *args: None)  # as where a processor adds tokens around the image
    data = _answers(tmp_path, [{"segments": ["<image> what ", "is the cat"], "image": _image(tmp_path).name, "answer": "a"}])
    assert main(["evaluate", str(data), "--model", str(llava), "--methods", "raw", "--output", str(tmp_path / "out")]) != 0
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "line 1: the processor adds tokens of its own around the image" in error  # before any work


def test_prompts_longer_than_the_model_takes_with_the_images_tokens_are_refused_before_any_work(llava, tmp_path, capsys):
    """The language model's 2,048 positions hold the prompt's 4 words but not its 2,048 with
    the image's 16 tokens: ``evaluate`` names the row (``--skip-malformed`` skips it),
    ``explain`` refuses the prompt, as they do a language model's."""
    long_prompt = " ".join(["what is the cat"] * 512)
    rows = [{"prompt": prompt, "image": _image(tmp_path).name, "answer": "is"} for prompt in ("what is the cat", long_prompt)]
    data, out = _answers(tmp_path, rows), tmp_path / "out"
    command = ["evaluate", str(data), "--model", str(llava), "--methods", "raw", "--metrics", "top_k_log_prob_drop", "--output", str(out)]
    message = "the prompt's 2065 tokens and the answer's 1 token are more than the 2048 the model takes (the image's tokens counted)"
    assert main(command) != 0
    error = capsys.readouterr().err
    assert f"line 2: {message}" in error and error.count("\n") == 1
    assert main([*command, "--skip-malformed"]) == 0
    assert f"skipped {data}, line 2: {message}" in capsys.readouterr().err
    assert [json.loads(line)["line"] for line in (out / "results.jsonl").read_text().splitlines()] == [1]
    assert main(["explain", "--model", str(llava), "--image", str(_image(tmp_path)), long_prompt, "--target", "is"]) == 1
    error = capsys.readouterr().err
    assert message.replace("the answer's", "the target's") in error and error.count("\n") == 1


@pytest.fixture(scope="module")
def florence2(tmp_path_factory):
    from vlm_models import save_florence2_checkpoint

    return _saved(tmp_path_factory, "florence2", save_florence2_checkpoint)


def _florence2_inputs(folder, image, prompt):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(folder, local_files_only=True).eval()
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    inputs = dict(processor(text=prompt, images=Image.open(image).convert("RGB"), return_tensors="pt"))
    return model, processor, inputs.pop("input_ids"), inputs.pop("attention_mask"), inputs


def test_explain_an_encoder_decoders_answer_about_an_image(florence2, tmp_path, capsys):
    """Florence-2's processor puts the image first itself (the prompt is given to it as it
    is: the image token put before it failed), its answer is its decoder's: the source's
    scores (the image's as one token) and the grid are the span's over the source,
    Integrated Gradients' are ``answer_integrated_gradients`` (checked against autograd in
    ``test_vlm_answers.py``); a generated answer is what its decoder wrote after its start
    token."""
    from captum_attention.presentation.explain import answer_integrated_gradients

    image, report = _image(tmp_path), tmp_path / "answer.json"
    assert main(["explain", "--model", str(florence2), "--image", str(image), "what is the cat", "--target", "is a",
                 "--methods", "grad_sam,attn_lrp,integrated_gradients", "--ig-steps", "4", "--json", str(report)]) == 0
    explanation = json.loads(report.read_text(encoding="utf-8"))
    assert explanation["prompt_tokens"] == ["<image>", "<s>", "what", "is", "the", "cat", "</s>"]
    model, processor, ids, mask, inputs = _florence2_inputs(florence2, image, "what is the cat")
    answer = torch.tensor([processor.tokenizer("is a", add_special_tokens=False)["input_ids"]])
    for name, cls in (("Grad-SAM", GradSAM), ("AttnLRP", AttnLRP)):
        source, _ = cls(model).attribute_span(ids, answer, additional_forward_args=(mask, inputs))
        (grid,) = image_scores(model, ids, source, inputs)[0]
        torch.testing.assert_close(torch.tensor(explanation["image_grids"][name]), grid)
        shown = [source[0, ids[0] == IMAGE].sum(), *source[0, ids[0] != IMAGE]]
        torch.testing.assert_close(torch.tensor(explanation["seq_attr"][name]), torch.stack(shown))
    assert explanation["seq_attr"]["AttnLRP"][0] != 0.0, "the image's tokens hold the relevance of its features"
    expected = answer_integrated_gradients(model, ids, answer, 4, inputs)
    torch.testing.assert_close(torch.tensor(explanation["seq_attr"]["Integrated Gradients"][1:]), expected[0, ids[0] != IMAGE])
    assert main(["explain", "--model", str(florence2), "--image", str(image), "what is the cat", "--methods", "raw",
                 "--max-new-tokens", "3", "--json", str(report)]) == 0
    with torch.no_grad():
        generated = model.generate(input_ids=ids, attention_mask=mask, **inputs, max_new_tokens=3, do_sample=False)
    assert json.loads(report.read_text(encoding="utf-8"))["answer"] == processor.tokenizer.decode(generated[0, 1:])


def test_evaluate_scores_an_encoder_decoders_answers_about_images(florence2, tmp_path):
    """``evaluate`` on Florence-2's rows: the metrics of each method's source scores, as the
    context metrics give them directly with the image inputs (they were refused), and
    Integrated Gradients of an image's answer among the methods."""
    from captum_attention.metrics import top_k_log_prob_drop

    image, out = _image(tmp_path), tmp_path / "out"
    data = _answers(tmp_path, [{"prompt": "what is the cat", "image": image.name, "answer": "is a"}])
    assert main(["evaluate", str(data), "--model", str(florence2), "--methods", "grad_sam,integrated_gradients",
                 "--ig-steps", "4", "--output", str(out)]) == 0
    rows = {row["method"]: row for row in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    model, processor, ids, mask, inputs = _florence2_inputs(florence2, image, "what is the cat")
    answer = torch.tensor([processor.tokenizer("is a", add_special_tokens=False)["input_ids"]])
    source, _ = GradSAM(model).attribute_span(ids, answer, additional_forward_args=(mask, inputs))
    keep = torch.tensor([[token in processor.tokenizer.all_special_ids for token in ids[0].tolist()]])
    segments = torch.arange(ids.shape[1])[None].masked_fill(keep, -1)
    drop = top_k_log_prob_drop(model, ids, mask, answer, source, ks=(3,), segments=segments, image_inputs=inputs)
    assert rows["grad_sam"]["top_k_log_prob_drop"] == pytest.approx(float(drop[0, 0]), abs=1e-5)
    assert set(rows) == {"grad_sam", "integrated_gradients"}
    assert rows["grad_sam"]["image_top_k_log_prob_drop"] is None, "an encoder-decoder's answer follows no prompt: not greyed"


@pytest.fixture(scope="module")
def blip(tmp_path_factory):
    return _saved(tmp_path_factory, "blip", save_blip_checkpoint)


def _blip_read(blip, image, prompt):
    """The tiny BLIP, the prompt as its ``generate`` reads it ([BOS] in place of the
    processor's [CLS], no [SEP]) and its image inputs."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(blip, local_files_only=True).eval()
    processor = AutoProcessor.from_pretrained(blip, local_files_only=True)
    inputs = dict(processor(text=prompt, images=Image.open(image).convert("RGB"), return_tensors="pt"))
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask")
    assert int(ids[0, 0]) == IMAGE and int(ids[0, -1]) == 2, "the processor's [CLS] ... [SEP]"
    read = torch.cat([torch.tensor([[1]]), ids[:, 1:-1]], dim=1)
    return model, processor, read, inputs


def test_explain_blips_caption_after_the_prompt_its_generate_reads(blip, tmp_path):
    """BLIP's prompt holds no image token: the report's ``<image>``, first, holds the image
    states' summed score, the words theirs, the grid :func:`image_scores`'; the caption is
    what ``generate`` gives after the prompt it reads."""
    from captum_attention import METHODS

    image, report = _image(tmp_path), tmp_path / "caption.json"
    assert main(["explain", "--model", str(blip), "--image", str(image), "the cat is", "--max-new-tokens", "3",
                 "--methods", "rollout,attn_lrp", "--json", str(report)]) == 0
    explanation = json.loads(report.read_text(encoding="utf-8"))
    model, processor, read, inputs = _blip_read(blip, image, "the cat is")
    generated = model.generate(input_ids=torch.cat([read, torch.tensor([[2]])], dim=1), **inputs, max_new_tokens=3, do_sample=False)
    answer = generated[:, read.shape[1] :]
    assert explanation["answer"] == processor.tokenizer.decode(answer[0])
    assert explanation["prompt_tokens"] == ["<image>", "<s>", "the", "cat", "is"]
    for name, method in (("Attention Rollout", "rollout"), ("AttnLRP", "attn_lrp")):
        states, text = METHODS[method](model).attribute_span(read, answer, additional_forward_args=(torch.ones_like(read), inputs))
        expected = torch.tensor([float(states.sum()), *text[0, : read.shape[1]].tolist()])
        torch.testing.assert_close(torch.tensor(explanation["seq_attr"][name]), expected, rtol=1e-5, atol=1e-7)
        (grid,) = image_scores(model, read, (states, text), inputs)[0]
        torch.testing.assert_close(torch.tensor(explanation["image_grids"][name]), grid, rtol=1e-5, atol=1e-9)


@pytest.fixture(scope="module")
def git(tmp_path_factory):
    return _saved(tmp_path_factory, "git", save_git_checkpoint)


def _git_read(git, image, prompt):
    """The GIT checkpoint, its processor, the prompt as its ``generate`` reads it ([CLS] and
    the words, the processor's [SEP] dropped) and the image inputs."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(git, local_files_only=True).eval()
    processor = AutoProcessor.from_pretrained(git, local_files_only=True)
    inputs = dict(processor(text=prompt, images=Image.open(image).convert("RGB"), return_tensors="pt"))
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask")
    assert int(ids[0, 0]) == 1 and int(ids[0, -1]) == 2, "the processor's [CLS] ... [SEP]"
    return model, processor, ids[:, :-1], inputs


def test_explain_gits_answer_with_its_image_features_first(git, tmp_path):
    """A GIT checkpoint (a GitForCausalLM) was refused with --image ("holds no
    vision-language model"): its text model reads the image's features before the
    prompt. The report's ``<image>``, first, holds the features' summed score, the words
    theirs, the grid :func:`image_scores`'; AttnLRP through the image encoder its pixels'
    relevance; the answer is what ``generate`` gives after [CLS] and the words."""
    from captum_attention import METHODS

    image, report = _image(tmp_path, 32, 32), tmp_path / "answer.json"
    assert main(["explain", "--model", str(git), "--image", str(image), "the cat is", "--max-new-tokens", "3",
                 "--methods", "rollout,attn_lrp", "--json", str(report)]) == 0
    explanation = json.loads(report.read_text(encoding="utf-8"))
    model, processor, read, inputs = _git_read(git, image, "the cat is")
    answer = model.generate(input_ids=read, **inputs, max_new_tokens=3, do_sample=False)[:, read.shape[1] :]
    assert explanation["answer"] == processor.tokenizer.decode(answer[0])
    assert explanation["prompt_tokens"] == ["<image>", "<s>", "the", "cat", "is"]
    args = (torch.ones_like(read), inputs)
    for name, method in (("Attention Rollout", "rollout"), ("AttnLRP", "attn_lrp")):
        features, text = METHODS[method](model).attribute_span(read, answer, additional_forward_args=args)
        expected = torch.tensor([float(features.sum()), *text[0, : read.shape[1]].tolist()])
        torch.testing.assert_close(torch.tensor(explanation["seq_attr"][name]), expected, rtol=1e-5, atol=1e-7)
        (grid,) = image_scores(model, read, (features, text), inputs)[0]
        torch.testing.assert_close(torch.tensor(explanation["image_grids"][name]), grid, rtol=1e-5, atol=1e-9)
    grey = processor(text="the cat is", images=Image.new("RGB", (32, 32), (128, 128, 128)), return_tensors="pt")["pixel_values"]
    text, pixels = AttnLRP(model).attribute_span(read, answer, additional_forward_args=args, through_vision_tower=True,
                                                 pixel_baselines=grey)
    expected = torch.tensor([float(pixels.sum()), *text[0, : read.shape[1]].tolist()])
    torch.testing.assert_close(torch.tensor(explanation["seq_attr"]["AttnLRP → pixels"]), expected, rtol=1e-5, atol=1e-7)


def test_explain_captions_with_gits_start_token_alone_and_refuses_a_models_missing_prompt(git, llava, tmp_path, capsys):
    """Without a prompt, a model that reads its image outside the prompt (GIT) captions it
    after [CLS] alone, Integrated Gradients on its pixels against the grey image (Captum's,
    by hand; it held the image and scored nothing); one whose prompt holds the image
    (LLaVA) is refused in one line."""
    image, report = _image(tmp_path, 32, 32), tmp_path / "caption.json"
    assert main(["explain", "--model", str(git), "--image", str(image), "--max-new-tokens", "3", "--methods",
                 "raw,integrated_gradients", "--ig-steps", "4", "--json", str(report)]) == 0
    assert "Integrated Gradients holds the image" not in capsys.readouterr().err
    explanation = json.loads(report.read_text(encoding="utf-8"))
    model, processor, read, inputs = _git_read(git, image, "")
    assert read.tolist() == [[1]]
    caption = model.generate(input_ids=read, **inputs, max_new_tokens=3, do_sample=False)[:, 1:]
    assert explanation["answer"] == processor.tokenizer.decode(caption[0]) and explanation["prompt_tokens"] == ["<image>", "<s>"]
    features, text = RawAttention(model).attribute_span(read, caption, additional_forward_args=(torch.ones_like(read), inputs))
    torch.testing.assert_close(torch.tensor(explanation["seq_attr"]["Raw Attention"]), torch.tensor([float(features.sum()), float(text[0, 0])]))
    grey = processor(images=Image.new("RGB", (32, 32), (128, 128, 128)), return_tensors="pt")["pixel_values"]
    grid = _pixel_integrated_gradients(model, read, inputs["pixel_values"], grey, caption, steps=4)
    assert grid.abs().sum() > 1e-3, "the pixels move the caption"
    torch.testing.assert_close(torch.tensor(explanation["image_grids"]["Integrated Gradients"]), grid, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.tensor(explanation["seq_attr"]["Integrated Gradients"]), torch.tensor([float(grid.sum()), 0.0]),
                               rtol=1e-4, atol=1e-6)
    capsys.readouterr()
    assert main(["explain", "--model", str(llava), "--image", str(image)]) == 1
    assert capsys.readouterr().err.strip().endswith("answers a prompt about the image: give the prompt (quoted), or --file")


@pytest.mark.parametrize("family", ["blip", "git"])
def test_evaluate_scores_answers_of_an_image_read_apart_as_the_model_does_alone(family, request, tmp_path):
    """BLIP (a prompt of 3 tokens as generate reads it, as many as the image's channels: its
    pixels were cut as a per-token input) and GIT: the top-3 drop removes the words, the
    start token and the image kept, against the model run on the start token alone with
    the pixels; of a longer prompt, the three words the method's token scores rank highest
    (they were ranked by the image's scores)."""
    from captum_attention import AttentionRollout

    folder, read_prompt = request.getfixturevalue(family), _blip_read if family == "blip" else _git_read
    prompt, size = ("the cat", 48) if family == "blip" else ("the cat is", 32)
    longer = "the cat is on the mat"
    image, out = _image(tmp_path, size, size), tmp_path / "out"
    data = _answers(tmp_path, [{"prompt": prompt, "image": image.name, "answer": "is a"},
                               {"prompt": longer, "image": image.name, "answer": "is a"}])
    assert main(["evaluate", str(data), "--model", str(folder), "--methods", "rollout", "--metrics", "top_k_log_prob_drop",
                 "--output", str(out)]) == 0
    short, long = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    model, processor, read, inputs = read_prompt(folder, image, prompt)
    answer = torch.tensor([processor.tokenizer("is a", add_special_tokens=False)["input_ids"]])
    assert read.shape[1] == len(prompt.split()) + 1 and (family == "git" or inputs["pixel_values"].shape[1] == 3)
    every = list(range(read.shape[1]))
    assert short["answer_log_prob"] == pytest.approx(_alone_log_prob(model, read, inputs, answer, every), abs=1e-5)
    assert short["top_k_log_prob_drop"] == pytest.approx(_drop_alone(model, read, inputs, answer, [0]), abs=1e-4)
    _, _, read, inputs = read_prompt(folder, image, longer)
    _, tokens = AttentionRollout(model).attribute_span(read, answer, additional_forward_args=(torch.ones_like(read), inputs))
    words = sorted(range(1, read.shape[1]), key=lambda i: (-float(tokens[0, i]), i))
    kept = [i for i in range(read.shape[1]) if i not in words[:3]]
    assert long["top_k_log_prob_drop"] == pytest.approx(_drop_alone(model, read, inputs, answer, kept), abs=1e-4)
    assert short["image_top_k_log_prob_drop"] is not None and set(short) - set(long) == set(), "the image's patches scored too"


def _pixels_log_prob(model, read, images, caption, token_type_ids=None):
    """``(images,)`` log p(caption | read, each image), the vision-language model run on
    the prompt ``read`` and the caption with each image's pixels (and the sequence's
    ``token_type_ids`` ``(1, read + caption)`` where given)."""
    sequence = torch.cat([read, caption], dim=1).expand(len(images), -1)
    types = {} if token_type_ids is None else {"token_type_ids": token_type_ids.expand(len(images), -1)}
    logits = model(input_ids=sequence, attention_mask=torch.ones_like(sequence), pixel_values=images, **types).logits
    return logits[:, -caption.shape[1] - 1 : -1].log_softmax(-1).gather(2, caption.expand(len(images), -1)[..., None]).sum(dim=(1, 2))


def _top_patches_greyed(pixels, grey, grid, k):
    """``pixels`` with the ``k`` cells of ``grid`` scored highest (ties by position) taken
    from ``grey``, each cell its block of pixels."""
    rows, columns = pixels.shape[-2] // grid.shape[0], pixels.shape[-1] // grid.shape[1]
    greyed = pixels.clone()
    for index in sorted(range(grid.numel()), key=lambda i: (-float(grid.flatten()[i]), i))[:k]:
        r, c = divmod(index, grid.shape[1])
        block = (..., slice(r * rows, (r + 1) * rows), slice(c * columns, (c + 1) * columns))
        greyed[block] = grey[block]
    return greyed


def _pixel_integrated_gradients(model, read, pixels, grey, caption, steps, token_type_ids=None):
    """Captum's IntegratedGradients of the caption's log-probability after ``read`` over a
    vision-language model's pixels against the grey ones, summed over channels and per
    patch of its vision tower."""
    from captum.attr import IntegratedGradients

    pixel_attr = IntegratedGradients(lambda images: _pixels_log_prob(model, read, images, caption, token_type_ids)).attribute(
        pixels, baselines=grey, n_steps=steps)
    patch = model.config.vision_config.patch_size
    rows, columns = pixels.shape[-2] // patch, pixels.shape[-1] // patch
    return pixel_attr[0].sum(dim=0).reshape(rows, patch, columns, patch).sum(dim=(1, 3)).detach()


@pytest.mark.parametrize("family", ["blip", "git"])
def test_evaluate_scores_captions_of_an_image_read_apart_over_its_patches(family, request, tmp_path):
    """Rows without a prompt, for BLIP or GIT, which caption after their start token alone
    (such rows were refused: "'prompt' is missing or empty"): the caption ``generate``
    writes, with the log-probability it scored, or the row's; AttnLRP's image states
    (features) on their grid and Integrated Gradients' pixels summed per patch (Captum's,
    by hand), each scored by its top-3 drop against the model run with those patches
    greyed by hand, and by the patch metrics called directly."""
    from captum_attention.metrics import patch_datamodeling_score, patch_leave_one_out_agreement

    folder, read_prompt = request.getfixturevalue(family), _blip_read if family == "blip" else _git_read
    size, out = 48 if family == "blip" else 32, tmp_path / "out"
    image = _image(tmp_path, size, size)
    data = _answers(tmp_path, [{"image": image.name}, {"image": image.name, "answer": "the cat"}])
    assert main(["evaluate", str(data), "--model", str(folder), "--methods", "attn_lrp,integrated_gradients", "--ig-steps", "4",
                 "--max-new-tokens", "3", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    model, processor, read, inputs = read_prompt(folder, image, "")
    assert read.tolist() == [[1]], "the start token alone"
    pixels, patch = inputs["pixel_values"], model.config.vision_config.patch_size
    grey = processor(images=Image.new("RGB", (size, size), (128, 128, 128)), return_tensors="pt")["pixel_values"]
    given = read if family == "git" else torch.cat([read, torch.tensor([[2]])], dim=1)  # BLIP's generate drops the last
    generated = model.generate(input_ids=given, **inputs, max_new_tokens=3, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
    captions = [generated.sequences[:, read.shape[1] :], torch.tensor([processor.tokenizer("the cat", add_special_tokens=False)["input_ids"]])]
    scored = sum(float(step.log_softmax(-1)[0, token]) for step, token in zip(generated.logits, captions[0][0]))
    assert [(row["index"], row["method"], row["generated"]) for row in rows] == [
        (0, "attn_lrp", True), (0, "integrated_gradients", True), (1, "attn_lrp", False), (1, "integrated_gradients", False)]

    for row in rows:
        caption = captions[row["index"]]
        assert row["answer"] == processor.tokenizer.decode(caption[0])
        expected_log_prob = scored if row["generated"] else _alone_log_prob(model, read, inputs, caption, [0])
        assert row["answer_log_prob"] == pytest.approx(expected_log_prob, abs=1e-5)
        if row["method"] == "attn_lrp":
            span = AttnLRP(model).attribute_span(read, caption, additional_forward_args=(torch.ones_like(read), inputs))
            grid = image_scores(model, read, span, inputs)[0][0].detach()
        else:
            grid = _pixel_integrated_gradients(model, read, pixels, grey, caption, steps=4)
        assert grid.shape == (pixels.shape[-2] // patch, pixels.shape[-1] // patch)
        greyed = _top_patches_greyed(pixels, grey, grid, 3)
        with torch.no_grad():
            drop = float(_pixels_log_prob(model, read, pixels, caption) - _pixels_log_prob(model, read, greyed, caption))
        assert abs(drop) > 1e-3, "the image moves the caption"
        assert row["top_k_log_prob_drop"] == pytest.approx(drop, abs=1e-4), row["method"]
        direct = {
            "lds": patch_datamodeling_score(model, pixels, caption, grid[None], grey, per_example=True, prompt_ids=read)[0],
            "loo_agreement": patch_leave_one_out_agreement(model, pixels, caption, grid[None], grey, prompt_ids=read)[0],
        }
        for metric, value in direct.items():
            assert row[metric] == pytest.approx(value.item(), abs=2e-4), (row["method"], metric)


@pytest.fixture(scope="module", params=["gpt2", "trocr", "donut"])
def captioner(request, tmp_path_factory):
    return _saved(tmp_path_factory, f"captioner_{request.param}", lambda folder: save_captioner_checkpoint(folder, request.param))


def _caption_integrated_gradients(model, processor, image, answer, steps):
    """Captum's IntegratedGradients of the caption's log-probability over the pixels
    against the processor's grey image, summed over channels and per first-stage patch."""
    from captum.attr import IntegratedGradients

    rgb = Image.open(image).convert("RGB")
    pixels = processor(images=rgb, return_tensors="pt")["pixel_values"]
    grey = processor(images=Image.new("RGB", rgb.size, (128, 128, 128)), return_tensors="pt")["pixel_values"]
    decoder = torch.cat([torch.ones_like(answer[:, :1]), answer[:, :-1]], dim=1)

    def log_prob(images):
        logits = model(pixel_values=images, decoder_input_ids=decoder.expand(len(images), -1)).logits
        return logits.log_softmax(dim=-1).gather(2, answer.expand(len(images), -1)[..., None]).sum(dim=(1, 2))

    pixel_attr = IntegratedGradients(log_prob).attribute(pixels, baselines=grey, n_steps=steps)[0].sum(dim=0)
    patch = model.config.encoder.patch_size
    rows, columns = pixel_attr.shape[0] // patch, pixel_attr.shape[1] // patch
    return pixel_attr.reshape(rows, patch, columns, patch).sum(dim=(1, 3)).detach()


def test_explain_a_captioners_caption_over_the_images_patches(captioner, tmp_path):
    """An image encoder before a text decoder (a ViT before GPT-2's or TrOCR's, Donut's
    Swin before its MBart) reads no prompt: the caption is what ``generate`` writes after the decoder's start token, the
    report's one prompt token ``<image>`` holds the patches' summed score, the grid and
    the spread the grid's, each caption token's grid the continuation's row, Integrated
    Gradients' grid Captum's on the pixels against a grey image, summed per patch (the
    checkpoint failed with an AttributeError)."""
    from transformers import AutoImageProcessor, AutoTokenizer, VisionEncoderDecoderModel

    from captum_attention import METHODS

    image, report, html = _image(tmp_path), tmp_path / "caption.json", tmp_path / "caption.html"
    assert main(["explain", "--model", str(captioner), "--image", str(image), "--max-new-tokens", "3", "--per-token",
                 "--methods", "rollout,attn_lrp,integrated_gradients", "--ig-steps", "4", "--json", str(report), "--html", str(html)]) == 0
    explanation = json.loads(report.read_text(encoding="utf-8"))
    model = VisionEncoderDecoderModel.from_pretrained(captioner, local_files_only=True).eval()
    processor = AutoImageProcessor.from_pretrained(captioner, local_files_only=True)
    pixels = processor(images=Image.open(image).convert("RGB"), return_tensors="pt")["pixel_values"]
    # the tokens the model chose: Donut's decoder forces its end token at the length limit, in place of the model's
    answer = model.generate(pixel_values=pixels, max_new_tokens=3, do_sample=False, forced_eos_token_id=None)[:, 1:]
    assert explanation["answer"] == AutoTokenizer.from_pretrained(captioner, local_files_only=True).decode(answer[0])
    assert explanation["prompt_tokens"] == ["<image>"] and explanation["grid_covers_image"] is True
    for name, method in (("Attention Rollout", "rollout"), ("AttnLRP", "attn_lrp")):
        patches, _ = METHODS[method](model).attribute_span(pixels, answer)
        torch.testing.assert_close(torch.tensor(explanation["seq_attr"][name]), patches[0].sum()[None], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(torch.tensor(explanation["image_grids"][name]), patches[0], rtol=1e-5, atol=1e-9)
        rows, _ = METHODS[method](model).attribute_continuation(pixels, answer, log_prob=True)
        torch.testing.assert_close(torch.tensor(explanation["token_grids"][name]), rows[0], rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(torch.tensor(explanation["token_attr"][name]), rows[0].sum(dim=(-2, -1))[:, None], rtol=1e-5, atol=1e-7)
    grid = _caption_integrated_gradients(model, processor, image, answer, steps=4)
    torch.testing.assert_close(torch.tensor(explanation["image_grids"]["Integrated Gradients"]), grid, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.tensor(explanation["seq_attr"]["Integrated Gradients"]), grid.sum()[None], rtol=1e-4, atol=1e-6)
    page, side = html.read_text(encoding="utf-8"), len(explanation["image_grids"]["AttnLRP"])
    assert "Integrated Gradients" not in explanation["token_attr"], "the whole caption only"
    assert page.count("data:image/png;base64,") == 3 + 2 * 3 and page.count(f"{side} × {side} grid over the image, the whole answer.</figcaption>") == 3
    assert "Each answer token (rows) over the prompt" not in page, "one prompt token: the grids alone"
    cells = [abs(cell) for row in explanation["image_grids"]["AttnLRP"] for cell in row]
    assert f"the image's patches: peak ×{max(cells) / (sum(cells) / len(cells)):.1f} the mean" in html_module.unescape(page)


def test_a_captioner_refuses_what_it_cannot_read_in_one_line(captioner, tmp_path, capsys):
    image = _image(tmp_path)
    assert main(["explain", "--model", str(captioner), "--image", str(image), "what is the cat"]) == 1
    assert "holds an image captioner, which reads no prompt: give only --image" in capsys.readouterr().err
    assert main(["explain", "--model", str(captioner)]) == 1
    assert "holds an image captioner: give the image with --image" in capsys.readouterr().err
    assert main(["explain", "--model", str(captioner), "--image", str(image), "--methods", "leave_one_out_estimates"]) == 1
    refusal = capsys.readouterr().err
    assert "leave_one_out_estimates is not available for an image captioner" in refusal and "attn_lrp" in refusal
    data = _answers(tmp_path, [{"prompt": "a cat", "image": image.name}])
    assert main(["evaluate", str(data), "--model", str(captioner), "--output", str(tmp_path / "out")]) == 1
    assert "line 1: an image captioner reads no prompt: leave 'prompt' and 'segments' out" in capsys.readouterr().err
    data = _answers(tmp_path, [{"image": image.name}])
    assert main(["evaluate", str(data), "--model", str(captioner), "--methods", "alti", "--output", str(tmp_path / "out")]) == 1
    assert "alti is not available for an image captioner" in capsys.readouterr().err
    assert main(["evaluate", str(_answers(tmp_path, [{"prompt": "a cat"}])), "--regions", "4", "--output", str(tmp_path / "out")]) == 1
    assert "--regions is for an image's patches; this model reads no image" in capsys.readouterr().err
    from captum_attention.loading import CheckpointError, load_causal_lm

    with pytest.raises(CheckpointError, match="holds an image captioner \\(explain it with --image\\), not a causal language model"):
        load_causal_lm(captioner)



def test_evaluate_scores_a_captioners_patches_as_the_patch_metrics_do_directly(captioner, tmp_path, capsys):
    """Each row's caption of its image (generated, or its ``answer``): AttnLRP's span and
    Integrated Gradients' grid (Captum's, by hand) scored by the patch metrics, a removed
    patch's pixels the processor's grey image's, Donut's 8 × 8 patches pooled into the 4 × 4
    regions asked for (the checkpoint was refused: evaluate's metrics removed a prompt's
    words); a run with a shard lost resumes to the same bytes."""
    from transformers import AutoImageProcessor, AutoTokenizer, VisionEncoderDecoderModel

    from captum_attention.metrics import patch_datamodeling_score, patch_leave_one_out_agreement, top_k_patch_log_prob_drop

    image = _image(tmp_path)
    data = _answers(tmp_path, [{"image": image.name}, {"image": image.name, "answer": "the cat"}])
    argv = ["evaluate", str(data), "--model", str(captioner), "--methods", "attn_lrp,integrated_gradients", "--ig-steps", "4",
            "--max-new-tokens", "3", "--regions", "4", "--output", str(tmp_path / "out")]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    model = VisionEncoderDecoderModel.from_pretrained(captioner, local_files_only=True).eval()
    processor = AutoImageProcessor.from_pretrained(captioner, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(captioner, local_files_only=True)
    rgb = Image.open(image).convert("RGB")
    pixels = processor(images=rgb, return_tensors="pt")["pixel_values"]
    grey = processor(images=Image.new("RGB", rgb.size, (128, 128, 128)), return_tensors="pt")["pixel_values"]
    captions = [model.generate(pixel_values=pixels, max_new_tokens=3, do_sample=False, forced_eos_token_id=None)[:, 1:],
                torch.tensor([tokenizer("the cat", add_special_tokens=False)["input_ids"]])]
    assert [(row["index"], row["method"], row["generated"]) for row in rows] == [
        (0, "attn_lrp", True), (0, "integrated_gradients", True), (1, "attn_lrp", False), (1, "integrated_gradients", False)]
    for row in rows:
        caption = captions[row["index"]]
        assert row["answer"] == tokenizer.decode(caption[0])
        decoder = torch.cat([torch.ones_like(caption[:, :1]), caption[:, :-1]], dim=1)
        with torch.no_grad():
            logits = model(pixel_values=pixels, decoder_input_ids=decoder).logits
        assert row["answer_log_prob"] == pytest.approx(logits.log_softmax(-1).gather(2, caption[..., None]).sum().item(), abs=1e-5)
        if row["method"] == "attn_lrp":
            scores = AttnLRP(model).attribute_span(pixels, caption)[0]
        else:
            scores = _caption_integrated_gradients(model, processor, image, caption, steps=4)[None]
        regions = (4, 4) if scores.shape[1] > 4 else None  # Donut's 8 × 8 first-stage patches pooled by --regions 4
        expected = {
            "top_k_log_prob_drop": top_k_patch_log_prob_drop(model, pixels, caption, scores, grey, ks=(3,), regions=regions)[0, 0],
            "lds": patch_datamodeling_score(model, pixels, caption, scores, grey, per_example=True, regions=regions)[0],
            "loo_agreement": patch_leave_one_out_agreement(model, pixels, caption, scores, grey, regions=regions)[0],
        }
        for metric, value in expected.items():
            assert row[metric] == pytest.approx(value.item(), abs=2e-4), (row["method"], metric)
    whole = (tmp_path / "out" / "results.jsonl").read_bytes()
    (tmp_path / "out" / "shards" / "batch-000001.jsonl").unlink()
    capsys.readouterr()
    assert main(argv) == 0
    assert "resuming: 1 of 2 captions already done" in capsys.readouterr().out
    assert (tmp_path / "out" / "results.jsonl").read_bytes() == whole


def test_a_registered_metric_scores_captions_only_where_it_says_it_removes_patches(captioner, tmp_path, capsys):
    """A generation metric registered for a prompt's segments is refused for captions in
    one line (it was handed the pixels and failed with its own error); one registered with
    ``patches=True`` gets the pixels, the patch grid's scores and the grey image."""
    from captum_attention.metrics import METRICS, register_metric

    seen = []

    @register_metric("prompt_only", "a prompt's metric", task="generation")
    def prompt_only(forward_func, inputs, attributions, additional_forward_args, target, context):
        raise AssertionError("never called for a caption")

    @register_metric("patch_count", "patches scored", task="generation", patches=True)
    def patch_count(forward_func, inputs, attributions, additional_forward_args, target, context):
        seen.append((inputs.dim(), attributions.dim(), context.patches.baseline_pixels.shape == inputs.shape))
        return torch.tensor([float(attributions[0].numel())])

    try:
        data = _answers(tmp_path, [{"image": _image(tmp_path).name}])
        argv = ["evaluate", str(data), "--model", str(captioner), "--methods", "rollout", "--max-new-tokens", "2",
                "--output", str(tmp_path / "out")]
        assert main([*argv, "--metrics", "patch_count,prompt_only"]) == 1
        refusal = capsys.readouterr().err.strip()
        assert "metric 'prompt_only' removes a prompt's segments" in refusal and "patches=True" in refusal and "\n" not in refusal
        assert not (tmp_path / "out").exists() and not seen
        assert main([*argv, "--metrics", "patch_count"]) == 0
        row = json.loads((tmp_path / "out" / "results.jsonl").read_text())
        assert seen == [(4, 3, True)] and row["patch_count"] > 1
        with pytest.raises(ValueError, match="patches=True is for a metric of task='generation'"):
            register_metric("patch_classifier", "refused", patches=True)(patch_count)
    finally:
        METRICS.pop("prompt_only", None)
        METRICS.pop("patch_count", None)
