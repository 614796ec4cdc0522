"""The command line for image classifiers (ViT, DeiT, Swin): the class of ``--image``, each
method's scores of its patches on their grid, in the terminal, the HTML and the JSON."""

from __future__ import annotations

import html as html_module
import json

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image

from captum_attention import METHODS
from captum_attention.presentation.cli import main

LABELS = {0: "cat", 1: "dog", 2: "bird"}


def _classifier(name: str) -> torch.nn.Module:
    """A tiny image classifier of :data:`LABELS` on 32 × 32 images."""
    torch.manual_seed(0)
    common = dict(image_size=32, num_channels=3, id2label=LABELS, label2id={v: k for k, v in LABELS.items()})
    if name == "swin":
        config = tf.SwinConfig(patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, **common)
        return tf.SwinForImageClassification(config).eval()
    vit = dict(patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
               initializer_range=0.3, **common)
    if name == "deit":
        return tf.DeiTForImageClassificationWithTeacher(tf.DeiTConfig(**vit)).eval()
    return tf.ViTForImageClassification(tf.ViTConfig(**vit)).eval()


@pytest.fixture(scope="module", params=["vit", "deit", "swin"])
def classifier(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("image_classifier") / request.param
    _classifier(request.param).save_pretrained(folder)
    tf.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def _saved_vit(tmp_path):
    folder = tmp_path / "vit"
    _classifier("vit").save_pretrained(folder)
    tf.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def _image(tmp_path):
    path = tmp_path / "image.png"
    Image.fromarray((np.random.default_rng(0).random((48, 48, 3)) * 255).astype("uint8")).save(path)
    return path


def _loaded(folder, image):
    model = tf.AutoModelForImageClassification.from_pretrained(folder, local_files_only=True).eval()
    processor = tf.AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    pixels = processor(images=Image.open(image).convert("RGB"), return_tensors="pt")["pixel_values"]
    grey = processor(images=Image.new("RGB", (48, 48), (128, 128, 128)), return_tensors="pt")["pixel_values"]
    return model, pixels, grey


def _integrated_gradients(model, pixels, grey, label, steps):
    """Captum's IntegratedGradients of the class's logit over the pixels against the grey
    image, summed over the channels and per patch of the model's first stage."""
    from captum.attr import IntegratedGradients

    pixel_attr = IntegratedGradients(lambda images: model(pixel_values=images).logits).attribute(
        pixels, baselines=grey, target=label, n_steps=steps
    )[0].sum(dim=0)
    patch = model.config.patch_size
    return pixel_attr.reshape(32 // patch, patch, 32 // patch, patch).sum(dim=(1, 3)).detach()


def test_explain_an_image_classifiers_prediction_over_the_images_patches(classifier, tmp_path, capsys):
    """The predicted class and its probability; each method's grid its own
    ``attribute(pixel_values, target=class)``; Integrated Gradients' Captum's on the pixels
    against a grey image, summed per patch; the HTML draws each grid over the image."""
    image, report, page = _image(tmp_path), tmp_path / "image.json", tmp_path / "image.html"
    assert main(["explain", "--model", str(classifier), "--image", str(image), "--methods", "rollout,attn_lrp,integrated_gradients",
                 "--ig-steps", "4", "--json", str(report), "--html", str(page)]) == 0
    out = capsys.readouterr().out
    model, pixels, grey = _loaded(classifier, image)
    with torch.no_grad():
        probabilities = model(pixel_values=pixels).logits.softmax(-1)[0]
    predicted = int(probabilities.argmax())
    explanation = json.loads(report.read_text(encoding="utf-8"))
    assert explanation["label"] == explanation["predicted"] == LABELS[predicted] and not explanation["given"]
    assert explanation["probability"] == pytest.approx(float(probabilities[predicted]), abs=1e-6)
    assert f"class, predicted: {LABELS[predicted]} (p {float(probabilities[predicted]):.3f})" in out
    for name, method in (("Attention Rollout", "rollout"), ("AttnLRP", "attn_lrp")):
        expected = METHODS[method](model).attribute(pixels, target=predicted)[0]
        assert expected.abs().max() > 0
        torch.testing.assert_close(torch.tensor(explanation["grids"][name]), expected, rtol=1e-5, atol=1e-9)
        assert out.count(f"{name} (") == 1
    expected = _integrated_gradients(model, pixels, grey, predicted, steps=4)
    torch.testing.assert_close(torch.tensor(explanation["grids"]["Integrated Gradients"]), expected, rtol=1e-4, atol=1e-6)
    assert explanation["grid_covers_image"] is True
    written = html_module.unescape(page.read_text(encoding="utf-8"))
    side = len(explanation["grids"]["AttnLRP"])
    assert written.count("data:image/png;base64,") == 3
    assert written.count(f"<figcaption>The image's {side} × {side} grid over the image, the class.</figcaption>") == 3
    assert f"Class (predicted): <b>{LABELS[predicted]}</b>" in written and "<script" not in written


def test_a_given_class_is_explained_and_the_prediction_named(classifier, tmp_path, capsys):
    image = _image(tmp_path)
    assert main(["explain", "--model", str(classifier), "--image", str(image), "--target", "Bird", "--methods",
                 "transformer_attribution", "--raw"]) == 0
    out = capsys.readouterr().out
    model, pixels, _ = _loaded(classifier, image)
    with torch.no_grad():
        probabilities = model(pixel_values=pixels).logits.softmax(-1)[0]
    assert f"class, given: bird (p {float(probabilities[2]):.3f}; predicted: {LABELS[int(probabilities.argmax())]})" in out
    grid = METHODS["transformer_attribution"](model).attribute(pixels, target=2)[0]
    lines = out.splitlines()
    start = lines.index(next(line for line in lines if line.startswith("Transformer Attribution (")))
    printed = [[float(value) for value in line.split()] for line in lines[start + 1: start + 1 + len(grid)]]
    torch.testing.assert_close(torch.tensor(printed), grid, rtol=5e-3, atol=1e-9)  # 3 significant digits


def test_what_an_image_classifier_cannot_take_is_refused_in_one_line(classifier, tmp_path, capsys):
    image = _image(tmp_path)

    def refused(*argv):
        assert main([*argv]) == 1
        return capsys.readouterr().err.strip()

    explain = ["explain", "--model", str(classifier)]
    assert refused(*explain, "a cat").endswith("holds an image classifier, which reads no text: give only --image (and --target "
                                               "to explain another class)")
    assert refused(*explain).endswith("holds an image classifier: give the image with --image")
    assert refused(*explain, "--image", str(image), "--per-token").endswith("--per-token: for text; an image classifier reads an image alone")
    assert refused(*explain, "--image", str(image), "--methods", "attn_lrp_presence").endswith(
        "attn_lrp_presence explain text, not an image's patches; choose --methods among grad_sam, rollout, transformer_attribution, raw, "
        "attention_flow, attn_lrp, norm_attention, value_zeroing, alti, learned_attention, knockout_gradient, knockout_lrp, decompx, "
        "integrated_gradients"
    )
    assert "alti_logit explains a language model's next-token logit" in refused(*explain, "--image", str(image), "--methods", "alti_logit")
    assert "'horse' is not a label of this model (labels: 0=cat, 1=dog, 2=bird)" in refused(*explain, "--image", str(image), "--target", "horse")
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"text": "a cat"}) + "\n")
    assert refused("evaluate", str(data), "--model", str(classifier)).endswith(
        "line 1: a row must be an object with an 'image' field (the image to classify) (pass --skip-malformed to skip such rows)"
    )
    data.write_text(json.dumps({"image": image.name}) + "\n")
    assert refused("evaluate", str(data), "--model", str(classifier), "--metrics", "comprehensiveness,decision_flip").endswith(
        "decision_flip: not over an image's patches (they erase the attention paid to tokens); "
        "choose --metrics among comprehensiveness, sufficiency, datamodeling, token_f1, auprc, pointing_game"
    )
    assert refused("evaluate", str(data), "--model", str(classifier), "--methods", "shap").endswith(
        "unknown method 'shap'; choose from grad_sam, rollout, transformer_attribution, raw, attention_flow, attn_lrp, "
        "norm_attention, value_zeroing, alti, learned_attention, knockout_gradient, knockout_lrp, decompx, integrated_gradients"
    )


def test_a_forward_only_methods_grid_is_drawn_in_blue_as_its_tokens_are(classifier, tmp_path):
    """Rollout's scores (the forward pass alone) are blue in the token rows: its grid over
    the image too, Grad-SAM's (support for the class) green."""
    import base64
    import io
    import re

    page = tmp_path / "image.html"
    assert main(["explain", "--model", str(classifier), "--image", str(_image(tmp_path)), "--methods", "rollout,grad_sam",
                 "--html", str(page)]) == 0
    figures = re.findall(r'src="data:image/png;base64,([^"]+)"', page.read_text(encoding="utf-8"))
    (_, green_rollout, blue_rollout), (_, green_sam, blue_sam) = (
        np.asarray(Image.open(io.BytesIO(base64.b64decode(figure))).convert("RGB"), dtype=np.float64).reshape(-1, 3).mean(0)
        for figure in figures
    )
    assert blue_rollout > green_rollout and green_sam > blue_sam


def test_evaluate_scores_an_image_classifiers_patches_as_the_metrics_do_directly(classifier, tmp_path, capsys):
    """Each row: the predicted class, and each metric the token-removal metric over the
    image's patches (image_patches, a removed patch greyed) computed on the image alone,
    whatever batch the image came in (the LDS's removals seeded by its pixels); the
    labels read by name or index; a second run resumes."""
    from captum_attention.metrics import aopc, comprehensiveness, datamodeling_score, image_patches, sufficiency

    rng = np.random.default_rng(3)
    rows = [("a.png", (48, 48), "cat"), ("b.png", (56, 40), None), ("c.png", (32, 32), 2)]
    for name, (width, height), _ in rows:
        Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8")).save(tmp_path / name)
    data, output = tmp_path / "images.jsonl", tmp_path / "out"
    data.write_text("".join(json.dumps({"image": name, **({} if label is None else {"label": label})}) + "\n"
                            for name, _, label in rows))
    command = ["evaluate", str(data), "--model", str(classifier), "--methods", "rollout,attn_lrp,integrated_gradients",
               "--ig-steps", "4", "--batch-size", "2", "--output", str(output)]
    assert main(command) == 0
    assert "| attn_lrp |" in capsys.readouterr().out
    written = [json.loads(line) for line in (output / "results.jsonl").read_text().splitlines()]
    assert len(written) == 3 * 3 and [row["label"] for row in written[::3]] == [0, None, 2]
    for row in written:
        name, (width, height), _ = rows[row["index"]]
        model, pixels, _ = _loaded(classifier, tmp_path / name)
        processor = tf.AutoImageProcessor.from_pretrained(classifier, local_files_only=True)
        grey = processor(images=Image.new("RGB", (width, height), (128, 128, 128)), return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            probabilities = model(pixel_values=pixels).logits.softmax(-1)[0]
        predicted = int(probabilities.argmax())
        assert row["predicted"] == predicted and row["probability"] == pytest.approx(float(probabilities[predicted]), abs=1e-6)
        if row["method"] == "integrated_gradients":
            grid = _integrated_gradients(model, pixels, grey, predicted, steps=4)[None]
        else:
            grid = METHODS[row["method"]](model).attribute(pixels, target=predicted).detach()
        patches = image_patches(model, pixels, grey, grid.shape[1:])
        arguments = (patches.forward_func, patches.input_ids, patches.attention_mask, grid.flatten(1), torch.tensor([predicted]))
        expected = {
            "comprehensiveness": aopc(comprehensiveness(*arguments, **patches.removal)),
            "sufficiency": aopc(sufficiency(*arguments, **patches.removal)),
            "datamodeling": datamodeling_score(*arguments, per_example=True, **patches.removal),
        }
        for metric, value in expected.items():
            assert row[metric] == pytest.approx(float(value[0]), abs=2e-4), (row["method"], metric)
    assert main(command) == 0
    assert "resuming: 2 of 2 batches already done" in capsys.readouterr().out


def test_a_convolutional_classifier_is_refused_by_the_attention_methods_and_explained_by_integrated_gradients(tmp_path, capsys):
    """ResNet's, ConvNeXt's: no attention to read; the error says what the command line can do."""
    labels = {0: "a", 1: "b"}
    folder = tmp_path / "convnext"
    config = tf.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, image_size=32, num_labels=2, id2label=labels,
                               label2id={v: k for k, v in labels.items()})
    torch.manual_seed(0)
    tf.ConvNextForImageClassification(config).eval().save_pretrained(folder)
    tf.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    image = _image(tmp_path)
    capsys.readouterr()
    assert main(["explain", "--model", str(folder), "--image", str(image), "--methods", "rollout"]) == 1
    error = capsys.readouterr().err.strip()
    assert error.startswith("captum-attention: error: No attention maps found in ConvNextForImageClassification") and error.endswith(
        "From the command line, --methods integrated_gradients explains it without attention.") and error.count("\n") == 0
    assert main(["explain", "--model", str(folder), "--image", str(image), "--methods", "integrated_gradients", "--ig-steps", "2"]) == 0
    assert "Integrated Gradients (" in capsys.readouterr().out


def test_a_class_is_named_as_imagenets_labels_name_it_and_a_wrong_name_gets_the_closest(tmp_path, capsys):
    """ImageNet's labels name a class several ways ("tabby, tabby cat"): any one names it;
    of a thousand labels, an error names the closest, not all."""
    from captum_attention.presentation.explain import resolve_target

    labels = {i: f"class {i}" for i in range(1000)} | {281: "tabby, tabby cat", 282: "tiger cat", 285: "Egyptian cat"}
    assert resolve_target("tabby cat", labels) == resolve_target("Tabby", labels) == resolve_target("tabby, tabby cat", labels) == 281
    assert resolve_target("tiger cat", labels) == 282 and resolve_target("7", labels) == 7
    with pytest.raises(ValueError) as error:
        resolve_target("egyptian kat", labels)
    assert str(error.value).startswith("target 'egyptian kat' is not a label of this model (1000 labels; the closest: 285=Egyptian cat")
    two = {0: "cat, feline", 1: "cat, tiger"}  # "cat" names both: neither is chosen
    with pytest.raises(ValueError, match=r"target 'cat' is not a label of this model \(labels: 0=cat, feline, 1=cat, tiger\)"):
        resolve_target("cat", two)


def test_a_checkpoint_saved_without_its_image_processor_is_told_to_save_it(tmp_path, capsys):
    folder = tmp_path / "alone"
    _classifier("vit").save_pretrained(folder)
    capsys.readouterr()
    assert main(["explain", "--model", str(folder), "--image", str(_image(tmp_path)), "--methods", "raw"]) == 1
    assert capsys.readouterr().err.strip() == (
        f"captum-attention: error: {folder} holds no image processor (no preprocessor_config.json): save the model's image "
        f"processor beside it (image_processor.save_pretrained({str(folder)!r}))."
    )


def test_a_processor_that_crops_the_borders_gets_its_grid_drawn_alone(tmp_path):
    """DeiT's and DINOv2's processors resize a square image larger than they read it and
    crop its borders: its grid covers the middle of the image, so it is drawn on its own,
    not laid over the whole image, as one that pads a wide image; ViT's resizes the whole
    image."""
    import shutil

    from captum_attention.presentation.answer import keeps_whole_image

    assert keeps_whole_image(tf.ViTImageProcessor(size={"height": 32, "width": 32}), (48, 48), 0.125, 0.125)
    cropping = tf.DeiTImageProcessor(size={"height": 48, "width": 48}, crop_size={"height": 32, "width": 32})
    assert not keeps_whole_image(cropping, (48, 48), 0.125, 0.125)
    assert not keeps_whole_image(tf.BitImageProcessor(size={"shortest_edge": 48}, crop_size={"height": 32, "width": 32}),
                                 (48, 48), 0.125, 0.125)

    def padding(images, return_tensors):
        """A processor that pads the image to a square with zeros at the bottom and right."""
        pixels = torch.tensor(np.asarray(images), dtype=torch.float32).permute(2, 0, 1) / 255
        side = max(pixels.shape[1:])
        return {"pixel_values": torch.nn.functional.pad(pixels, (0, side - pixels.shape[2], 0, side - pixels.shape[1]))[None]}

    assert not keeps_whole_image(padding, (48, 32), 0.125, 0.125) and keeps_whole_image(padding, (48, 48), 0.125, 0.125)
    wide, report = tmp_path / "wide.png", tmp_path / "wide.json"  # ViT's processor squeezes a wide photo whole
    Image.fromarray((np.random.default_rng(1).random((36, 64, 3)) * 255).astype("uint8")).save(wide)
    assert main(["explain", "--model", str(_saved_vit(tmp_path)), "--image", str(wide), "--methods", "raw", "--json", str(report)]) == 0
    assert json.loads(report.read_text(encoding="utf-8"))["grid_covers_image"] is True
    torch.manual_seed(0)
    folder = tmp_path / "deit"
    _classifier("vit").save_pretrained(folder)
    cropping.save_pretrained(folder)
    report, page = tmp_path / "deit.json", tmp_path / "deit.html"
    assert main(["explain", "--model", str(folder), "--image", str(_image(tmp_path)), "--methods", "rollout", "--json", str(report),
                 "--html", str(page)]) == 0
    assert json.loads(report.read_text(encoding="utf-8"))["grid_covers_image"] is False
    assert "not laid over the image, of which it covers another part or shape (its processor crops or pads it)" in page.read_text(
        encoding="utf-8")
    shutil.rmtree(folder)


def test_a_boxs_patches_are_those_whose_centres_it_holds():
    """A 4 × 4 grid over a 64 × 32 image: cells of 16 × 8 pixels, centres at x = 8, 24,
    40, 56 and y = 4, 12, 20, 28; a box that holds no centre marks the cell of its own."""
    from captum_attention.metrics import box_patches

    cells = box_patches((0, 0, 30, 13), (64, 32), (4, 4)).reshape(4, 4)
    assert cells.nonzero().tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert box_patches((9, 9, 23, 15), (64, 32), (4, 4)).reshape(4, 4).nonzero().tolist() == [[1, 1]]  # its centre: (16, 12)
    assert box_patches((0, 0, 64, 32), (64, 32), (4, 4)).all()
    with pytest.raises(ValueError, match="not within the 64 × 32 image"):
        box_patches((10, 0, 70, 5), (64, 32), (4, 4))


def _boxed_rows(tmp_path, boxes):
    rng = np.random.default_rng(5)
    for name, _ in boxes:
        Image.fromarray((rng.random((48, 64, 3)) * 255).astype("uint8")).save(tmp_path / name)
    data = tmp_path / "boxed.jsonl"
    data.write_text("".join(json.dumps({"image": name, **({} if box is None else {"box": box})}) + "\n" for name, box in boxes))
    return data


def test_evaluate_plays_the_pointing_game_against_each_rows_box(tmp_path, capsys):
    """Rows with boxes get the box's metrics by default: the pointing game (the method's
    top patch among the box's), token F1 and AUPRC against the patches in the box, each as
    the metric computes it on the image's grid alone."""
    from captum_attention.metrics import auprc, box_patches, token_f1

    folder = _saved_vit(tmp_path)
    boxes = [("a.png", [0, 0, 40, 30]), ("b.png", [30, 20, 64, 48]), ("c.png", [2, 2, 5, 5])]
    data, output = _boxed_rows(tmp_path, boxes), tmp_path / "out"
    assert main(["evaluate", str(data), "--model", str(folder), "--methods", "rollout,attn_lrp", "--output", str(output)]) == 0
    assert "pointing_game" in capsys.readouterr().out
    written = [json.loads(line) for line in (output / "results.jsonl").read_text().splitlines()]
    assert len(written) == 6
    for row in written:
        name, box = boxes[row["index"]]
        model, pixels, _ = _loaded(folder, tmp_path / name)
        with torch.no_grad():
            predicted = int(model(pixel_values=pixels).logits.argmax())
        grid = METHODS[row["method"]](model).attribute(pixels, target=predicted).detach().flatten(1)
        centres_x, centres_y = (torch.arange(4) + 0.5) * 16, (torch.arange(4) + 0.5) * 12  # 64 × 48 in a 4 × 4 grid
        inside = ((centres_y >= box[1]) & (centres_y < box[3]))[:, None] & ((centres_x >= box[0]) & (centres_x < box[2]))[None]
        if not inside.any():  # the small box: the cell of its centre (3.5, 3.5)
            inside[0, 0] = True
        assert torch.equal(inside.flatten(), box_patches(box, (64, 48), (4, 4)))
        rationale = inside.flatten()[None]
        assert row["pointing_game"] == float(rationale[0, int(grid.argmax())])
        assert row["token_f1"] == pytest.approx(float(token_f1(grid, rationale)), abs=1e-6)
        assert row["auprc"] == pytest.approx(float(auprc(grid, rationale)), abs=1e-6)
        assert row["comprehensiveness"] is not None


def test_box_metrics_without_boxes_or_over_a_cropped_image_are_refused_in_one_line(tmp_path, capsys):
    folder = _saved_vit(tmp_path)
    data = _boxed_rows(tmp_path, [("a.png", [0, 0, 40, 30]), ("b.png", None)])
    assert main(["evaluate", str(data), "--model", str(folder), "--methods", "raw", "--output", str(tmp_path / "o1")]) == 0
    written = [json.loads(line) for line in (tmp_path / "o1" / "results.jsonl").read_text().splitlines()]
    assert "pointing_game" not in written[0]  # not every row has a box: the box's metrics are left out by default
    assert main(["evaluate", str(data), "--model", str(folder), "--metrics", "pointing_game", "--output", str(tmp_path / "o2")]) == 1
    error = capsys.readouterr().err.strip()
    assert "pointing_game compare with the object's box: give a 'box'" in error and "(line 2 has none)" in error
    for box, said in (([0, 0, 40], "'box' must be [x0, y0, x1, y1]"), ([0, 0, 70, 30], "is not within the 64 × 48 image"),
                      ([5, 0, 4, 30], "x0 < x1")):
        bad = _boxed_rows(tmp_path, [("a.png", box)])
        assert main(["evaluate", str(bad), "--model", str(folder), "--output", str(tmp_path / "o3")]) == 1
        assert said in capsys.readouterr().err
    csv = tmp_path / "boxed.csv"
    csv.write_text('image,box\na.png,"0 0 40 30"\n')
    from captum_attention.presentation.dataset import read_images

    assert read_images(csv)[0][0].box == (0.0, 0.0, 40.0, 30.0)
    cropping = tmp_path / "deit"
    _classifier("vit").save_pretrained(cropping)
    tf.DeiTImageProcessor(size={"height": 48, "width": 48}, crop_size={"height": 32, "width": 32}).save_pretrained(cropping)
    boxed = _boxed_rows(tmp_path, [("a.png", [0, 0, 40, 30])])
    assert main(["evaluate", str(boxed), "--model", str(cropping), "--methods", "raw", "--output", str(tmp_path / "o4")]) == 1
    error = capsys.readouterr().err.strip()
    assert "the image processor crops or pads the 64 × 48 image of line 1" in error and len(error.splitlines()) == 1
