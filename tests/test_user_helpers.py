"""The helpers users and tutorials call: display scaling, the demo tasks, SHAP alignment."""

from __future__ import annotations

import warnings

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from captum_attention import scores_for_display, special_tokens, token_heatmap, upsample_to_image  # noqa: E402
from captum_attention.demo.recall import ASK, KEYS, VALUES, VOCAB, recall_batch  # noqa: E402
from captum_attention.demo.shapes import PATCH, SQUARE, shape_images  # noqa: E402


class _Tokenizer:
    all_special_ids = [0, 101, 102]


def test_special_tokens_marks_the_tokenizers_special_ids():
    ids = torch.tensor([[101, 7, 8, 102, 0]])
    assert special_tokens(ids, _Tokenizer()).tolist() == [[True, False, False, True, True]]
    assert special_tokens(ids.tolist(), _Tokenizer()).tolist() == [[True, False, False, True, True]]  # a tokenizer's list


def test_scores_for_display_leaves_special_tokens_out_of_the_scale():
    scores = torch.tensor([[5.0, 0.2, -0.4, 1.0], [0.0, 0.0, 0.0, 0.0]])
    special = torch.tensor([[True, False, False, True], [True, False, False, True]])
    shown = scores_for_display(scores, special)
    torch.testing.assert_close(shown[0], torch.tensor([0.0, 0.5, 1.0, 0.0]))
    assert shown[1].eq(0).all(), "an all-zero example stays zero"
    signed = scores_for_display(scores, special, signed=True)
    torch.testing.assert_close(signed[0], torch.tensor([0.0, 0.5, -1.0, 0.0]))


def test_scores_for_display_scales_each_patch_grid_by_itself():
    grids = torch.stack([torch.full((2, 2), 3.0), torch.arange(4.0).view(2, 2)])
    shown = scores_for_display(grids)
    assert shown.shape == grids.shape
    assert shown.flatten(1).amax(dim=1).tolist() == [1.0, 1.0]


def test_scores_for_display_refuses_scores_no_scale_shows():
    """One NaN made its whole example NaN, an inf every other score 0."""
    special = torch.tensor([[False, True, False]] * 3)
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match=r"^scores hold NaN or ±inf in examples \[1\] \(among the entries shown\)"):
            scores_for_display(torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, bad], [0.0, 0.0, 0.0]]), special)
    shown = scores_for_display(torch.tensor([[1.0, float("nan"), 2.0]] * 3), special)  # left out: no matter
    torch.testing.assert_close(shown[0], torch.tensor([0.5, 0.0, 1.0]))


def test_scores_for_display_names_a_mismatched_mask():
    with pytest.raises(ValueError, match="special has shape"):
        scores_for_display(torch.ones(2, 4), torch.ones(2, 3, dtype=torch.bool))


def test_an_encoder_decoders_pair_of_scores_is_told_to_be_shown_a_side_at_a_time():
    """``attribute_span`` of an encoder-decoder returns (source, target): the helpers
    failed with "'tuple' object has no attribute 'detach'"."""
    pair = (torch.rand(1, 4), torch.rand(1, 3))
    with pytest.raises(TypeError, match=r"^scores is a tuple of 2 \(an encoder-decoder's source and target scores"):
        scores_for_display(pair)
    with pytest.raises(TypeError, match=r"^scores\['a'\] is a tuple of 2 "):
        token_heatmap({"a": pair}, ["w", "x", "y", "z"])
    with pytest.raises(TypeError, match=r"^scores must be a tensor, got list\.$"):
        scores_for_display([0.5, 1.0])
    with pytest.raises(TypeError, match=r"^grid_scores is a tuple of 2 "):
        upsample_to_image((torch.rand(1, 2, 2), torch.rand(1, 3, 8, 8)), torch.rand(1, 3, 8, 8))


def test_token_heatmap_draws_one_row_per_method():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a tensor handed to matplotlib warns under numpy 2
        ax = token_heatmap({"a": torch.tensor([0.0, 1.0]), "b": torch.tensor([1.0, 0.5])}, ["x", "y"], title="t")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b"]
    assert ax.get_images()[0].get_array().shape == (2, 2)


def test_token_heatmap_refuses_rows_it_would_draw_wrong():
    """Fewer scores than tokens drew under the wrong labels, raw scores above 1 were clipped
    to the scale's top, and a batch of one or rows of two lengths failed in matplotlib or torch."""
    tokens = ["x", "y", "z"]
    ax = token_heatmap({"a": torch.tensor([[0.0, 1.0, 0.5]])}, tokens)  # a batch of one: its row
    assert ax.get_images()[0].get_array().shape == (1, 3)
    with pytest.raises(ValueError, match=r"^scores\['a'\] has shape \(2,\), not one score per token \(3,\)\.$"):
        token_heatmap({"a": torch.tensor([0.0, 1.0])}, tokens)
    with pytest.raises(ValueError, match=r"^scores\['b'\] has shape \(4,\)"):
        token_heatmap({"a": torch.zeros(3), "b": torch.zeros(4)}, tokens)
    for raw in (torch.tensor([0.0, 2.0, 0.5]), torch.tensor([0.0, float("nan"), 0.5])):
        with pytest.raises(ValueError, match=r"outside \[-1, 1\] \(or not finite\).*scores_for_display"):
            token_heatmap({"a": raw}, tokens)


def test_recall_batches_mark_the_pair_each_answer_comes_from():
    batch = recall_batch(50, seed=3)
    for row in range(50):
        ids = batch.input_ids[row]
        assert ids[4] == ASK
        for asked, position in enumerate(batch.answer_positions[row].tolist()):
            key, answer = VOCAB[int(ids[position])], VOCAB[int(ids[position + 1])]
            assert key in KEYS and answer in VALUES and int(ids[position + 1]) == int(batch.answers[row, asked])
            (pair,) = batch.decisive[row, asked].nonzero().flatten().tolist()
            assert VOCAB[int(ids[pair])] == f"{key}={answer}"


def test_shape_images_mark_exactly_the_patches_the_square_covers():
    images, labels, squares = shape_images(20, seed=1, with_none=True)
    for image, label, square in zip(images, labels, squares):
        coloured = (image[0] == 1) & (image[1] == 0) if label == 0 else (image[1] == 1) & (image[0] == 0)
        covered = coloured.view(8, PATCH, 8, PATCH).any(dim=(1, 3)) if label < 2 else torch.zeros(8, 8, dtype=torch.bool)
        assert torch.equal(covered, square)
        assert int(coloured.sum()) == (SQUARE * SQUARE if label < 2 else 0)
