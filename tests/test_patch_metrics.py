"""The context metrics over an image captioner's patches, against the model run by hand on
each image with its patches greyed one block of pixels at a time."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_same_state, model_state
from scipy.stats import spearmanr
from vlm_models import DONUT, IMAGE, make_blip, make_captioner, make_vlm

from captum_attention import AttnLRP, image_scores
from captum_attention.metrics import (
    METRICS,
    MetricContext,
    PatchRemoval,
    patch_datamodeling_score,
    patch_leave_one_out_agreement,
    top_k_patch_log_prob_drop,
)
from captum_attention.metrics.context import shared_ablations
from captum_attention.metrics.token_removal import example_seeds, random_halves

PIXELS = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
GREY = torch.full((1, 3, 32, 32), 0.25)
CAPTION = torch.tensor([[8, 9, 10], [11, 12, 13]])
SCORES = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(5))


def caption_log_prob(model, pixels: torch.Tensor, caption: torch.Tensor) -> float:
    """log p(caption | one image), the decoder reading its start token (1) and the caption."""
    decoder = torch.cat([torch.ones(1, 1, dtype=torch.long), caption[None, :-1]], dim=1)
    with torch.no_grad():
        logits = model(pixel_values=pixels[None], decoder_input_ids=decoder).logits[0].double()
    return float(sum(logits[k].log_softmax(-1)[token] for k, token in enumerate(caption.tolist())))


def answer_log_prob(model, ids: torch.Tensor, answer: torch.Tensor, pixels: torch.Tensor, **token_inputs: torch.Tensor) -> float:
    """log p(answer | the prompt ``ids`` ``(1, m)``, one image), a vision-language model
    reading the prompt, then the answer ``(n,)``, with ``token_inputs`` over both."""
    sequence = torch.cat([ids, answer[None]], dim=1)
    with torch.no_grad():
        logits = model(input_ids=sequence, pixel_values=pixels[None], **token_inputs).logits[0, ids.shape[1] - 1 : -1].double()
    return float(sum(logits[k].log_softmax(-1)[token] for k, token in enumerate(answer.tolist())))


def greyed(pixels: torch.Tensor, patches: list[int], grid: int = 4) -> torch.Tensor:
    """One image with the pixels of ``patches`` (row by row of the ``grid``) made grey."""
    image = pixels.clone()
    side = pixels.shape[-1] // grid
    for patch in patches:
        row, column = divmod(patch, grid)
        image[:, row * side : (row + 1) * side, column * side : (column + 1) * side] = GREY[0, :, :side, :side]
    return image


@pytest.fixture(scope="module")
def captioner():
    return make_captioner("gpt2")


def test_the_top_k_drop_greys_the_highest_scored_patches(captioner):
    before = model_state(captioner)
    drops = top_k_patch_log_prob_drop(captioner, PIXELS, CAPTION, SCORES, GREY, ks=(1, 3))
    assert_same_state(before, model_state(captioner))
    for example in range(2):
        order = SCORES[example].flatten().argsort(descending=True).tolist()
        whole = caption_log_prob(captioner, PIXELS[example], CAPTION[example])
        for column, k in enumerate((1, 3)):
            after = caption_log_prob(captioner, greyed(PIXELS[example], order[:k]), CAPTION[example])
            assert drops[example, column].item() == pytest.approx(whole - after, abs=1e-4)
    assert drops.abs().max() > 1e-3, "greying patches moves the caption"


def test_a_vision_language_captioner_reads_its_prompt_then_the_caption_with_the_greyed_image():
    """BLIP, given ``prompt_ids`` (its start token, once for the batch): each example's
    caption after the start token, its image's top-k patches greyed, the text decoder
    run by hand on each image's states."""
    model, start = make_blip(), torch.tensor([[1]])
    before = model_state(model)
    drops = top_k_patch_log_prob_drop(model, PIXELS, CAPTION, SCORES, GREY, ks=(1, 3), prompt_ids=start)
    assert_same_state(before, model_state(model))

    def by_hand(pixels: torch.Tensor, caption: torch.Tensor) -> float:
        with torch.no_grad():
            states = model.vision_model(pixel_values=pixels[None]).last_hidden_state
            logits = model.text_decoder(input_ids=torch.cat([start[0], caption])[None], encoder_hidden_states=states).logits[0]
        return float(sum(logits[k].double().log_softmax(-1)[token] for k, token in enumerate(caption.tolist())))

    for example in range(2):
        order = SCORES[example].flatten().argsort(descending=True).tolist()
        whole = by_hand(PIXELS[example], CAPTION[example])
        for column, k in enumerate((1, 3)):
            after = by_hand(greyed(PIXELS[example], order[:k]), CAPTION[example])
            assert drops[example, column].item() == pytest.approx(whole - after, abs=1e-4)
    assert drops.abs().max() > 1e-3, "greying patches moves the caption"
    with pytest.raises(ValueError, match="prompt_ids must be token ids \\(1 or batch=2, prompt_len >= 1\\)"):
        top_k_patch_log_prob_drop(model, PIXELS, CAPTION, SCORES, GREY, prompt_ids=torch.ones(1, 1))


def test_a_vision_language_models_answer_about_its_image_is_scored_over_the_images_patches():
    """LLaVA's answer after its prompt (BOS, the image's 16 tokens, two words), given as
    ``prompt_ids``: AttnLRP's image tokens on their 4 × 4 grid (:func:`image_scores`),
    which tiles the pixels; the top-k drop against the model run by hand on each image
    with those patches greyed."""
    model = make_vlm("llava")
    ids = torch.tensor([[1, *[IMAGE] * 16, 5, 6]])
    answer = torch.tensor([[8, 9]])
    images = {"pixel_values": PIXELS[:1]}
    span = AttnLRP(model).attribute_span(ids, answer, additional_forward_args=(torch.ones_like(ids), images))
    (grid,) = image_scores(model, ids, span, images)[0]
    drops = top_k_patch_log_prob_drop(model, PIXELS[:1], answer, grid[None].detach(), GREY, ks=(1, 3), prompt_ids=ids)

    def by_hand(pixels: torch.Tensor) -> float:
        return answer_log_prob(model, ids, answer[0], pixels)

    order = grid.flatten().argsort(descending=True).tolist()
    for column, k in enumerate((1, 3)):
        assert drops[0, column].item() == pytest.approx(by_hand(PIXELS[0]) - by_hand(greyed(PIXELS[0], order[:k])), abs=1e-4)
    assert drops.abs().max() > 1e-3, "greying patches moves the answer"


def test_a_prompts_per_token_inputs_are_read_as_the_models_generate_extends_them():
    """PaliGemma's prompt read both ways (``token_type_ids`` 0), its answer causally (1):
    given as ``prompt_inputs``, the top-k drop of each of a batch of two images against the
    model run by hand with those token types; without them the model reads another prefix;
    inputs of another length, or without ``prompt_ids``, are refused."""
    model = make_vlm("paligemma")
    ids = torch.tensor([[*[IMAGE] * 16, 1, 5, 6]])
    types = {"token_type_ids": torch.zeros_like(ids)}
    answer = torch.tensor([[8, 9], [8, 9]])
    drops = top_k_patch_log_prob_drop(model, PIXELS, answer, SCORES, GREY, ks=(1, 3), prompt_ids=ids, prompt_inputs=types)
    untyped = top_k_patch_log_prob_drop(model, PIXELS, answer, SCORES, GREY, ks=(1, 3), prompt_ids=ids)

    def by_hand(pixels: torch.Tensor) -> float:
        read = torch.cat([types["token_type_ids"], torch.ones_like(answer[:1])], dim=1)
        return answer_log_prob(model, ids, answer[0], pixels, token_type_ids=read)

    for example in range(2):
        order = SCORES[example].flatten().argsort(descending=True).tolist()
        for column, k in enumerate((1, 3)):
            expected = by_hand(PIXELS[example]) - by_hand(greyed(PIXELS[example], order[:k]))
            assert drops[example, column].item() == pytest.approx(expected, abs=1e-4)
    assert (drops - untyped).abs().max() > 1e-4, "the token types change how the answer is read"
    with pytest.raises(ValueError, match=r"prompt_inputs\['token_type_ids'\] must be a per-token tensor \(1 or batch=2, prompt_len=19"):
        top_k_patch_log_prob_drop(model, PIXELS, answer, SCORES, GREY, prompt_ids=ids, prompt_inputs={"token_type_ids": ids[:, :-1]})
    with pytest.raises(ValueError, match="give the prompt's prompt_ids too"):
        top_k_patch_log_prob_drop(model, PIXELS, answer, SCORES, GREY, prompt_inputs=types)


def test_the_lds_ranks_the_kept_patches_scores_against_the_greyed_images(captioner):
    lds = patch_datamodeling_score(captioner, PIXELS, CAPTION, SCORES, GREY, num_ablations=8, seed=4, per_example=True)
    present = torch.ones(2, 16, dtype=torch.bool)
    kept = random_halves(present, 8, 4, example_seeds(PIXELS.flatten(1), None, 4))
    for example in range(2):
        actual = [
            caption_log_prob(captioner, greyed(PIXELS[example], (~keep).nonzero().flatten().tolist()), CAPTION[example])
            for keep in kept[example]
        ]
        predicted = (kept[example].double() * SCORES[example].flatten().double()).sum(dim=1)
        assert lds[example].item() == pytest.approx(spearmanr(predicted, actual).statistic, abs=1e-6)


def test_each_examples_lds_is_its_own_in_any_batch(captioner):
    together = patch_datamodeling_score(captioner, PIXELS, CAPTION, SCORES, GREY, num_ablations=6, per_example=True)
    alone = patch_datamodeling_score(captioner, PIXELS[1:], CAPTION[1:], SCORES[1:], GREY, num_ablations=6, per_example=True)
    assert together[1].item() == pytest.approx(alone[0].item(), abs=1e-6)


def test_large_images_go_fewer_to_a_forward(captioner, monkeypatch):
    """The greyed images of one forward hold at most ``VALUES_PER_FORWARD`` pixel values:
    with room for one 32 × 32 image, each of the 16 leave-one-out images runs alone, with
    the same values."""
    from captum_attention.metrics import patches

    batched = patch_leave_one_out_agreement(captioner, PIXELS[:1], CAPTION[:1], SCORES[:1], GREY)
    sizes = []
    handle = captioner.register_forward_pre_hook(lambda _, args, kwargs: sizes.append(len(kwargs["pixel_values"])), with_kwargs=True)
    monkeypatch.setattr(patches, "VALUES_PER_FORWARD", 3 * 32 * 32)
    try:
        alone = patch_leave_one_out_agreement(captioner, PIXELS[:1], CAPTION[:1], SCORES[:1], GREY)
    finally:
        handle.remove()
    assert set(sizes) == {1} and len(sizes) == 17  # the whole image, then each patch greyed
    assert alone.item() == pytest.approx(batched.item(), abs=1e-6)


def test_leave_one_out_agreement_ranks_each_greyed_patchs_drop(captioner):
    agreement = patch_leave_one_out_agreement(captioner, PIXELS, CAPTION, SCORES, GREY)
    for example in range(2):
        whole = caption_log_prob(captioner, PIXELS[example], CAPTION[example])
        effects = [whole - caption_log_prob(captioner, greyed(PIXELS[example], [p]), CAPTION[example]) for p in range(16)]
        assert agreement[example].item() == pytest.approx(spearmanr(SCORES[example].flatten(), effects).statistic, abs=1e-5)


def test_regions_pool_whole_patches_as_evenly_as_the_grid_allows(captioner):
    """3 × 3 regions of the 4 × 4 patches: rows (and columns) of patches {0, 1}, {2}, {3};
    a region scores its patches' sum and is greyed whole."""
    groups = [[0, 1], [2], [3]]
    regions = [[row * 4 + column for row in rows for column in columns] for rows in groups for columns in groups]
    drops = top_k_patch_log_prob_drop(captioner, PIXELS, CAPTION, SCORES, GREY, ks=(1, 2), regions=(3, 3))
    agreement = patch_leave_one_out_agreement(captioner, PIXELS, CAPTION, SCORES, GREY, regions=(3, 3))
    checked = 0
    for example in range(2):
        summed = torch.stack([SCORES[example].flatten()[region].sum() for region in regions])
        order = summed.argsort(descending=True).tolist()
        whole = caption_log_prob(captioner, PIXELS[example], CAPTION[example])
        for column, k in enumerate((1, 2)):
            patches = [patch for region in order[:k] for patch in regions[region]]
            assert drops[example, column].item() == pytest.approx(whole - caption_log_prob(captioner, greyed(PIXELS[example], patches), CAPTION[example]), abs=1e-4)
        effects = [whole - caption_log_prob(captioner, greyed(PIXELS[example], region), CAPTION[example]) for region in regions]
        if min(abs(a - b) for i, a in enumerate(effects) for b in effects[:i]) > 1e-5:  # else float32 may break a tie either way
            checked += 1
            assert agreement[example].item() == pytest.approx(spearmanr(summed, effects).statistic, abs=1e-5)
    assert checked >= 1


def test_donuts_first_stage_patches_are_greyed_on_their_grid():
    """Donut's scores lie on its first stage's 8 × 8 patches of 4 pixels."""
    donut = make_captioner(DONUT)
    patches, _ = AttnLRP(donut).attribute_span(PIXELS[:1], CAPTION[:1])
    assert patches.shape == (1, 8, 8)
    drop = top_k_patch_log_prob_drop(donut, PIXELS[:1], CAPTION[:1], patches, GREY, ks=(2,))
    order = patches[0].flatten().argsort(descending=True).tolist()
    whole = caption_log_prob(donut, PIXELS[0], CAPTION[0])
    assert drop[0, 0].item() == pytest.approx(whole - caption_log_prob(donut, greyed(PIXELS[0], order[:2], grid=8), CAPTION[0]), abs=1e-4)


def test_the_registered_metrics_grey_patches_where_the_context_holds_a_baseline(captioner):
    """``evaluate``'s metrics for a captioner: the same values as the functions, each
    ablation run once for every metric and method in a shared scope."""
    calls = []
    handle = captioner.register_forward_hook(lambda *_: calls.append(1))
    context = MetricContext(captioner, torch.zeros(1, 0, dtype=torch.bool), patches=PatchRemoval(GREY))
    try:
        with shared_ablations():
            values = {name: METRICS[name].function(captioner, PIXELS[:1], SCORES[:1], (), CAPTION[:1], context)
                      for name in ("top_k_log_prob_drop", "lds", "loo_agreement")}
            first = len(calls)
            again = METRICS["loo_agreement"].function(captioner, PIXELS[:1], -SCORES[:1], (), CAPTION[:1], context)
    finally:
        handle.remove()
    assert len(calls) == first, "another method's scores reuse the greyed images' log-probabilities"
    assert again.item() == pytest.approx(-values["loo_agreement"].item(), abs=1e-6)
    expected = {
        "top_k_log_prob_drop": top_k_patch_log_prob_drop(captioner, PIXELS[:1], CAPTION[:1], SCORES[:1], GREY, ks=(3,))[:, 0],
        "lds": patch_datamodeling_score(captioner, PIXELS[:1], CAPTION[:1], SCORES[:1], GREY, per_example=True),
        "loo_agreement": patch_leave_one_out_agreement(captioner, PIXELS[:1], CAPTION[:1], SCORES[:1], GREY),
    }
    for name, value in values.items():
        assert value.item() == pytest.approx(expected[name].item(), abs=1e-6), name


@pytest.mark.parametrize("scores, baseline, message", [
    (torch.zeros(2, 3, 3), GREY, "does not tile 32x32 pixels"),
    (torch.zeros(2, 16), GREY, "patch scores \\(batch, rows, columns\\)"),
    (torch.zeros(2, 4, 4), torch.zeros(1, 3, 16, 16), "baseline_pixel_values must be shaped as pixel_values"),
    (torch.full((2, 4, 4), float("nan")), GREY, "NaN"),
])
def test_scores_off_the_grid_and_a_baseline_of_another_size_are_refused(captioner, scores, baseline, message):
    with pytest.raises(ValueError, match=message):
        top_k_patch_log_prob_drop(captioner, PIXELS, CAPTION, scores, baseline)


@pytest.mark.parametrize("regions", [(5, 4), (0, 2), (2,)])
def test_regions_beyond_the_patches_are_refused(captioner, regions):
    with pytest.raises(ValueError, match="regions must be \\(rows, columns\\) of at least 1 and at most the 4x4 patches"):
        patch_leave_one_out_agreement(captioner, PIXELS, CAPTION, SCORES, GREY, regions=regions)


def test_a_captioners_forced_first_token_is_read_not_scored(captioner):
    """A decoder whose generate forces the caption's first token
    (generation_config.forced_bos_token_id): the caption's log-probability leaves it out,
    as the spans do."""
    import copy

    from captum_attention.metrics.patches import read_caption_log_probs

    forcing = copy.deepcopy(captioner)
    forcing.generation_config.forced_bos_token_id = 8
    captions = torch.tensor([[8, 9, 10], [8, 12, 13]])
    scored = read_caption_log_probs(forcing, PIXELS, captions)
    for example in range(2):
        whole = caption_log_prob(captioner, PIXELS[example], captions[example])
        decoder = torch.tensor([[1, *captions[example, :-1].tolist()]])
        with torch.no_grad():
            first = captioner(pixel_values=PIXELS[example : example + 1], decoder_input_ids=decoder).logits[0, 0].double()
        assert scored[example].item() == pytest.approx(whole - float(first.log_softmax(-1)[8]), abs=1e-4)
    unforced = read_caption_log_probs(captioner, PIXELS, captions)[0].item()
    assert unforced == pytest.approx(caption_log_prob(captioner, PIXELS[0], captions[0]), abs=1e-4)
