"""Explain a causal language model's answer to one prompt with every method, through
Captum's LLM interface."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from captum.attr import LayerIntegratedGradients, LLMGradientAttribution, TextTokenInput

from ..attr import METHODS, REGISTRY, LLMAttentionAttribution, image_scores, pixel_scores
from ..attr._images import grid_follows_image
from ..capture.adapters.images import (
    cross_attends_images, generate_inputs, image_encoder_config, image_outside_prompt, prompt_as_generated,
)
from ..capture.adapters.protocol import per_token as is_per_token
from ..capture.inputs import CHOSEN_END, end_tokens, forced_tokens, with_forced_token
from ..metrics.patches import read_caption_log_probs
from .display import outside_span, readable_tokens, special_tokens
from .explain import (
    ESTIMATES, ESTIMATES_BY_SHARE, ESTIMATES_OF_ANSWERS, IG_TOKENS_PER_BATCH, INTEGRATED_GRADIENTS, PRESENCE, SIGNED, MethodInfo,
    answer_estimates, answer_integrated_gradients, answer_span, answer_too_long, check_methods, presence_display, registered_method,
    removable_segments, span_presence,
)


@dataclass
class AnswerExplanation:
    """What the report of one answer shows.

    Attributes:
        prompt_tokens: the prompt's tokens (the features).
        special: per prompt token, whether it is a special token (left out of the scale).
        answer_tokens: the answer's tokens, as Captum shows them.
        answer: the answer's text.
        generated: whether the model generated the answer (else it was given).
        seq_attr: method -> score of each prompt token for the whole answer.
        token_attr: method -> one row of prompt-token scores per answer token (empty
            without ``per_token``).
        seconds: method -> wall time.
        methods: method -> how to read its scores.
        skipped: the prompt tokens left out of the features (``skip``), in order.
        warnings: what the reader should know about the answer (a generation cut at its
            token limit).
        image: a vision-language model's image file (its tokens are the prompt token
            ``<image>``, their scores summed), or None.
        image_grids: method -> the image tokens' scores for the whole answer on their
            grid (rows of columns); empty where the family's layout is unknown. For
            ``AttnLRP → pixels``, the pixels' relevance summed per patch.
        token_grids: method -> per answer token, the image tokens' scores for that token
            on their grid (with ``per_token``, where ``image_grids`` holds the whole answer's).
        grid_covers_image: whether the grid's shape follows the image's (its cells can be
            laid over the image: a processor that resizes it whole).
        template: per prompt token, whether the chat template wrote it rather than the
            user's message (``--chat``; empty otherwise): left out of the scale and of the
            top tokens, as the special tokens are.
    """

    prompt_tokens: list[str]
    special: list[bool]
    answer_tokens: list[str]
    answer: str
    generated: bool
    seq_attr: dict[str, list[float]] = field(default_factory=dict)
    token_attr: dict[str, list[list[float]]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    methods: dict[str, MethodInfo] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    image: str | None = None
    image_grids: dict[str, list[list[float]]] = field(default_factory=dict)
    token_grids: dict[str, list[list[list[float]]]] = field(default_factory=dict)
    grid_covers_image: bool = False
    template: list[bool] = field(default_factory=list)

    @property
    def left_out(self) -> list[bool]:
        """Per prompt token, whether the reports leave it out of the scale and of the top
        tokens: a special token, or one the chat template wrote."""
        return [special or (i < len(self.template) and self.template[i]) for i, special in enumerate(self.special)]


def explain_answer(
    model: Any,
    tokenizer: Any,
    prompt: str,
    target: str | None = None,
    max_new_tokens: int = 20,
    methods: list[str] | None = None,
    per_token: bool = False,
    ig_steps: int = 50,
    skip: str | None = None,
    presence: float = 0.05,
    message: str | None = None,
) -> AnswerExplanation:
    """Generate (greedy) or take the answer to ``prompt``, then explain it with each method
    (registry names; ``integrated_gradients`` runs Captum's
    ``LLMGradientAttribution(LayerIntegratedGradients)``; ``attn_lrp_presence`` AttnLRP
    with the prompt's tokens at ``presence``, its special tokens and the answer at 1).
    Default: the methods of reports (:data:`~captum_attention.METHODS`). ``skip``: a
    regular expression; the prompt tokens it matches in full are left out of the features,
    as Captum's ``skip_tokens`` leaves them out. ``message``: the user's message, where
    ``prompt`` is it in a chat template (:func:`chat_prompt`): the template's own tokens
    are marked (:attr:`AnswerExplanation.template`).
    """
    chosen = methods or list(METHODS)
    check_methods(chosen, answers=True, one_stack=not getattr(model.config, "is_encoder_decoder", False))
    ids = tokenizer.encode(prompt, return_tensors="pt")[0]
    shown = readable_tokens(ids, tokenizer)  # "the", not GPT-2's "Ġthe"
    skip_ids = sorted({
        token for token, text in zip(ids.tolist(), shown) if skip is not None and re.fullmatch(skip, text.strip())
    })
    inp = TextTokenInput(prompt, tokenizer, skip_tokens=skip_ids or None)
    kept = [True] * len(shown) if inp.itp_mask is None else inp.itp_mask[0].tolist()
    skipped = [text for text, is_kept in zip(shown, kept) if not is_kept]
    special_ids = set(tokenizer.all_special_ids)
    if skipped and all(int(i) in special_ids for i in inp.itp_tensor[0].tolist()):
        raise ValueError(f"skip {skip!r} matches every prompt token but the special ones, leaving none to explain: skip fewer")
    gen_args = None if target is not None else {"max_new_tokens": max_new_tokens, "do_sample": False}
    answer_ids = target_ids(model, tokenizer, inp, target, gen_args)
    written = None if message is None else written_by_template(tokenizer, prompt, message, ids.tolist())
    explanation = AnswerExplanation(
        prompt_tokens=[text for text, is_kept in zip(shown, kept) if is_kept],
        special=[int(i) in special_ids for i in inp.itp_tensor[0].tolist()],
        answer_tokens=readable_tokens(answer_ids.cpu(), tokenizer), answer=tokenizer.decode(answer_ids),
        generated=target is None, skipped=skipped,
        template=[] if written is None else [wrote for wrote, is_kept in zip(written, kept) if is_kept],
        warnings=_listed(unknown_words(tokenizer, prompt, ids.tolist())) + (
            _cut_warning(model, tokenizer, answer_ids, max_new_tokens) if target is None
            else _listed(glued_answer(model, tokenizer, ids.tolist(), target, answer_ids.tolist()))
        ) + _forced_note(model, tokenizer, answer_ids),
    )
    for name in chosen:
        display = presence_display(presence) if name == PRESENCE else _display(name)
        start = time.perf_counter()
        if name in ESTIMATES_OF_ANSWERS:
            _add_method(explanation, display, SIGNED, start, _estimates(model, tokenizer, inp, answer_ids, name != ESTIMATES, written))
            continue
        if name == INTEGRATED_GRADIENTS and getattr(model.config, "is_encoder_decoder", False):
            _add_method(explanation, display, SIGNED, start, _source_integrated_gradients(model, inp, answer_ids, ig_steps))
            continue
        wrapper, info = _wrapper(model, tokenizer, name)
        options = {"presence": span_presence(inp.to_model_input(), len(answer_ids), tokenizer, presence)} if name == PRESENCE else {}
        if name == INTEGRATED_GRADIENTS:
            result = wrapper.attribute(inp, target=answer_ids, n_steps=ig_steps)
        else:
            result = wrapper.attribute(inp, target=answer_ids, per_token=per_token, **options)
        _add_method(explanation, display, info, start, result.seq_attr, result.token_attr if per_token else None)
    return explanation


def _estimates(
    model: Any, tokenizer: Any, inp: TextTokenInput, answer_ids: torch.Tensor, by_share: bool, written: list[bool] | None = None
) -> torch.Tensor:
    """``(features,)``: :data:`~captum_attention.presentation.explain.ESTIMATES` (``by_share``:
    :data:`~captum_attention.presentation.explain.ESTIMATES_BY_SHARE`) of the prompt's
    features, each token its own segment; the special tokens, the skipped ones and those
    the chat template wrote (``written``, per token) are never removed, as ``evaluate``
    keeps them."""
    ids = inp.to_model_input()
    features = torch.ones_like(ids, dtype=torch.bool) if inp.itp_mask is None else inp.itp_mask
    keep = special_tokens(ids, tokenizer) | ~features | _per_token_flags(written, ids)
    return _prompt_estimates(model, ids, answer_ids, keep, by_share)[features]


def _source_integrated_gradients(model: Any, inp: TextTokenInput, answer_ids: torch.Tensor, steps: int) -> torch.Tensor:
    """``(features,)``: Integrated Gradients of an encoder-decoder's answer over its source's
    features (:func:`~captum_attention.presentation.explain.answer_integrated_gradients`;
    Captum's ``LLMGradientAttribution`` takes decoder-only models)."""
    ids = inp.to_model_input()
    features = torch.ones_like(ids, dtype=torch.bool) if inp.itp_mask is None else inp.itp_mask.bool()
    device = next(model.parameters()).device
    scores = answer_integrated_gradients(model, ids.to(device), answer_ids.to(device)[None], steps)
    return scores.cpu()[features.cpu()]


def _prompt_estimates(
    model: Any, ids: torch.Tensor, answer_ids: torch.Tensor, keep: torch.Tensor, by_share: bool,
    image_inputs: dict[str, Any] | None = None,
) -> torch.Tensor:
    """``(1, N)`` float32 on the CPU: the estimates (``by_share``: by share) of the prompt
    ``ids`` ``(1, N)`` for ``answer_ids`` ``(n,)``, each token its own segment but those of
    ``keep`` (and a vision-language model's image tokens, which the context metrics never
    remove), run on the model's device."""
    device = next(model.parameters()).device
    images = None if image_inputs is None else {
        name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in image_inputs.items()
    }
    segments = removable_segments(keep.to(device), None)
    return answer_estimates(model, ids.to(device), answer_ids.to(device)[None], segments, by_share, image_inputs=images).float().cpu()


def _add_method(
    explanation: AnswerExplanation, display: str, info: MethodInfo, start: float, scores: torch.Tensor,
    rows: torch.Tensor | None = None, grid: torch.Tensor | None = None, row_grids: torch.Tensor | None = None,
) -> None:
    """A method's results in ``explanation`` under ``display``, timed from ``start``: its
    ``scores`` of the whole answer, one per feature, and where given each answer token's
    (``rows``), and the image grid of the whole answer (``grid``) and of each answer token
    (``row_grids``)."""
    explanation.seconds[display] = time.perf_counter() - start
    explanation.methods[display] = info
    explanation.seq_attr[display] = scores.detach().float().tolist()
    if rows is not None:
        explanation.token_attr[display] = rows.detach().float().tolist()
    if grid is not None:
        explanation.image_grids[display] = grid.detach().float().tolist()
    if row_grids is not None:
        explanation.token_grids[display] = row_grids.detach().float().tolist()


def _per_token_flags(flags: list[bool] | None, ids: torch.Tensor) -> torch.Tensor:
    """``flags`` (one per token of ``ids``, or None: all False) as a tensor shaped as ``ids``."""
    return torch.zeros_like(ids, dtype=torch.bool) if flags is None else torch.tensor(flags, device=ids.device).reshape(ids.shape)


def _listed(warning: str | None) -> list[str]:
    return [] if warning is None else [warning]


def unknown_words(tokenizer: Any, text: str, ids: list[int], shown: int | None = None, named: str = "prompt") -> str | None:
    """A warning where the tokenizer read words of ``text`` (tokenized as ``ids``) as its
    unknown token, or as its padding (a word-level vocabulary's unknown token may be its
    pad token): the model reads every such word alike, and the report leaves them out as
    special tokens. Else None. A token the text holds literally, or that is also the end
    or start token (a pad token set to the end token), is no unknown word. ``shown``: how
    many tokens the report shows the prompt as (an image's run of tokens as one); default:
    the ids'. ``named``: what the text is called."""
    literal = {tokenizer.eos_token, tokenizer.bos_token}
    candidates = dict.fromkeys((tokenizer.unk_token, tokenizer.pad_token))
    names = [name for name in candidates if name and name not in text and name not in literal]
    unknown = {tokenizer.convert_tokens_to_ids(name) for name in names}
    count = sum(1 for token in ids if token in unknown)
    if not count:
        return None
    return (
        f"the tokenizer read {count} of the {named}'s {shown or len(ids)} tokens as {' or '.join(names)}: words its vocabulary "
        f"does not hold, which the model reads alike and the report leaves out as special tokens; write the {named} in "
        "the model's vocabulary"
    )


def _cut_warning(model: Any, tokenizer: Any, answer_ids: torch.Tensor, max_new_tokens: int) -> list[str]:
    """A warning where generation stopped at ``max_new_tokens`` (more than one: a first
    token asked for alone runs past nothing) with no end token (the tokenizer's, or any
    that ``generate`` stops at): the answer may run on past what the model meant to say,
    and the explanation covers it all."""
    ends = {tokenizer.eos_token_id, *end_tokens(model)}
    if max_new_tokens == 1 or len(answer_ids) < max_new_tokens or ends & set(answer_ids.tolist()):
        return []
    return [
        f"the answer stopped at --max-new-tokens ({max_new_tokens}) without an end token: it may go on past the "
        "model's real answer, and the whole-answer scores explain all of it; give --target, or a smaller --max-new-tokens"
    ]


def _forced_note(model: Any, tokenizer: Any, answer_ids: torch.Tensor) -> list[str]:
    """A note where the answer's first token is the one an encoder-decoder's ``generate``
    forces (:func:`~captum_attention.capture.inputs.forced_tokens`): shown in the answer,
    read, and not explained."""
    if not forced_tokens(model, answer_ids.reshape(1, -1)):
        return []
    first = readable_tokens(answer_ids[:1], tokenizer)[0]
    return [
        f"the answer's first token, {first!r}, is the one the model's generate forces there "
        "(generation_config.forced_bos_token_id): the decoder reads it, and the whole-answer scores explain the tokens after it"
    ]


def grey_image_warning(pixels: Any, grey: torch.Tensor | None) -> list[str]:
    """A warning where the image is the uniform grey image that the pixels' scores are
    measured against (``grey``; None where none is): those scores are then 0 everywhere."""
    if grey is None or not isinstance(pixels, torch.Tensor) or pixels.shape != grey.shape or not torch.equal(pixels, grey):
        return []
    return ["the image is the uniform grey image its pixels' scores are measured against: they are 0 everywhere"]


def glued_answer(model: Any, tokenizer: Any, prompt_ids: list[int], answer: str, answer_ids: list[int]) -> str | None:
    """A warning where a decoder-only ``model``'s given ``answer`` is read glued to the
    prompt's last word, which is rarely the answer meant: GPT-2's and Qwen's tokenizers put
    no space before it ("is" and "Paris" read "isParis"; SentencePiece's add one
    themselves); else None (an encoder-decoder's answer is its decoder's own text)."""
    if getattr(model.config, "is_encoder_decoder", False):
        return None
    prompt = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    joined = tokenizer.decode(prompt_ids + answer_ids, skip_special_tokens=True)
    after = joined[len(prompt):] if joined.startswith(prompt) else ""
    if not (prompt.strip() and after.strip() and prompt[-1].isalnum() and after[0].isalnum()):
        return None
    read = prompt.split()[-1] + after.split()[0]
    return (
        f"the answer {answer!r} is read glued to the prompt's last word, as {read!r}: begin it with a space "
        f"({' ' + answer!r}) if the model writes one there"
    )


def chat_prompt(tokenizer: Any, message: str | list[dict[str, str]], templates: Any = None) -> str:
    """``message`` (text, or a vision-language model's list of an image and text) as the
    user's turn in the chat template of ``templates`` (default: the tokenizer; a
    processor), with the generation prompt after it (what an instruct model was trained to
    answer), as text the tokenizer reads back to the template's tokens
    (:func:`without_added_bos`); a one-line error where there is no chat template."""
    templates = tokenizer if templates is None else templates
    if getattr(templates, "chat_template", None) is None:
        holder = "tokenizer" if templates is tokenizer else "processor"
        raise ValueError(
            f"the model's {holder} ({type(templates).__name__}) has no chat template (a base model's): leave --chat out, "
            "and the prompt is read as it is"
        )
    text = templates.apply_chat_template([{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True)
    return without_added_bos(tokenizer, str(text))


def written_by_template(tokenizer: Any, prompt: str, message: str, ids: list[int]) -> list[bool]:
    """Per token ``ids`` of ``prompt``, whether the chat template wrote it, as ``evaluate``
    tells them apart (:func:`~captum_attention.presentation.display.outside_span`: its
    first visible character lies outside the user's ``message``, at its last place in
    ``prompt``); none is marked where the tokenizer gives no offsets, reads ``prompt`` to
    other ids, or the template changed the message's text."""
    start = prompt.rfind(message) if message else -1
    if start < 0 or not getattr(tokenizer, "is_fast", False):
        return [False] * len(ids)
    encoded = tokenizer(prompt, return_offsets_mapping=True, return_tensors="pt")
    if encoded["input_ids"][0].tolist() != ids:
        return [False] * len(ids)
    return outside_span(encoded["offset_mapping"][0], prompt, (start, start + len(message))).tolist()


def without_added_bos(tokenizer: Any, prompt: str) -> str:
    """``prompt`` without the BOS token's text it begins with where the tokenizer adds that
    token itself (Llama's, Gemma's, Mistral's, with a chat template's text pasted in), so
    that the model reads one BOS, as the template means, not two."""
    bos = tokenizer.bos_token
    if not bos or not prompt.startswith(bos):
        return prompt
    doubled = tokenizer(prompt)["input_ids"][:2] == [tokenizer.bos_token_id] * 2
    return prompt[len(bos):] if doubled else prompt


def target_ids(model: Any, tokenizer: Any, inp: TextTokenInput, target: str | None, gen_args: dict[str, Any] | None) -> torch.Tensor:
    """The answer's token ids: ``target`` tokenized without special tokens, or the greedy
    generation (Captum's own target handling)."""
    return LLMAttentionAttribution(METHODS["raw"](model), tokenizer).target_tokens(inp, target, gen_args)


def _display(name: str) -> str:
    names = {INTEGRATED_GRADIENTS: "Integrated Gradients", ESTIMATES: "Leave-one-out estimates",
             ESTIMATES_BY_SHARE: "Leave-one-out estimates, by share"}
    return names.get(name) or REGISTRY[name].get_name()


def _wrapper(model: Any, tokenizer: Any, name: str) -> tuple[Any, MethodInfo]:
    """The LLM attribution of method ``name`` and how to read it (every score explains the
    answer's log-probability, so each uses the target)."""
    if name == INTEGRATED_GRADIENTS:
        layer = LayerIntegratedGradients(model, model.get_input_embeddings())
        return LLMGradientAttribution(layer, tokenizer), SIGNED
    explainer = registered_method("attn_lrp" if name == PRESENCE else name, model)
    return LLMAttentionAttribution(explainer, tokenizer), MethodInfo.of(explainer)


IMAGE_TOKEN = "<image>"
"""How the report shows an image's tokens: one prompt token, their scores summed."""


def explain_image_answer(
    model: Any,
    processor: Any,
    prompt: str,
    image_path: str,
    target: str | None = None,
    max_new_tokens: int = 20,
    methods: list[str] | None = None,
    per_token: bool = False,
    chat: bool = False,
    ig_steps: int = 50,
) -> AnswerExplanation:
    """A vision-language model's answer to ``prompt`` about the image at ``image_path``
    (the processor's image token put first where the prompt holds none; with ``chat``, the
    image and the prompt as the user's turn in the processor's chat template), explained by each
    method: the text tokens' scores, the image's tokens summed as one ``<image>`` token,
    and their scores on the image's grid (:func:`~captum_attention.image_scores`). AttnLRP
    also runs through the vision tower (``AttnLRP → pixels``: its relevance on the pixels
    against a uniform grey image of the same size through the same processor, summed per
    patch by :func:`~captum_attention.pixel_scores`), where that function knows the
    pixels' layout. The leave-one-out estimates (:data:`~captum_attention.presentation.explain.ESTIMATES`)
    never remove the image, as the context metrics never do, and Integrated Gradients
    (``ig_steps`` steps) holds it (:func:`~captum_attention.presentation.explain.answer_integrated_gradients`):
    its ``<image>`` token scores 0 there, and they have no grid or rows per answer token,
    except that Integrated Gradients also runs on the pixels against the grey image, the
    prompt held, summed per patch as its grid and as ``<image>``'s score
    (:func:`caption_integrated_gradients`), where the image is one picture's pixels alone
    (:func:`single_image_pixels`) whose layout :func:`~captum_attention.pixel_scores`
    knows. BLIP's or GIT's caption (an empty ``prompt``) rests on the image alone: its words
    then score 0."""
    from PIL import Image

    chosen = methods or list(METHODS)
    check_methods(chosen, answers=True, one_stack=not several_stacks(model))
    image = Image.open(image_path).convert("RGB")
    text, ids, mask, inputs = image_prompt_inputs(processor, prompt, image, chat, with_image_token=not image_outside_prompt(model))
    tokenizer = processor.tokenizer
    too_long = image_answer_too_long(model, tokenizer, ids.shape[1], target, max_new_tokens, "the target")
    if too_long is not None:
        raise ValueError(too_long)
    answer_ids = image_answer_ids(model, tokenizer, ids, mask, inputs, target, max_new_tokens)
    ids, mask = prompt_as_generated(model, ids, mask)
    if answer_ids.numel() == 0:
        raise ValueError("The answer has no tokens: give a non-empty target, or generate at least one token.")
    template = image_template_tokens(model, tokenizer, text, prompt, ids[0]) if chat else None
    features, names, special, written = _image_features(model, ids[0], tokenizer, template)
    explanation = AnswerExplanation(
        prompt_tokens=names, special=special, template=written if chat else [],
        answer_tokens=readable_tokens(answer_ids, tokenizer), answer=tokenizer.decode(answer_ids), generated=target is None,
        warnings=_listed(unknown_words(tokenizer, text, ids[0].tolist(), len(names)))
        + (_cut_warning(model, tokenizer, answer_ids, max_new_tokens) if target is None else [])
        + _forced_note(model, tokenizer, answer_ids), image=str(image_path),
    )
    args = (mask, inputs)
    has_grid = _has_grid(model, ids, inputs)
    if not has_grid:
        explanation.warnings.append(
            f"the layout of {getattr(model.config, 'model_type', type(model).__name__)}'s image tokens is not known: "
            "the report shows their summed score, not their grid"
        )
    captioning = not prompt.strip() and image_outside_prompt(model)  # nothing but the image to score
    pixel_ig = INTEGRATED_GRADIENTS in chosen and single_image_pixels(model, inputs, ids.shape[1]) is not None and _pixels_on_grid(
        model, inputs["pixel_values"], inputs)
    grey = (
        processor(text=text, images=Image.new("RGB", image.size, (128, 128, 128)), return_tensors="pt")["pixel_values"]
        if ("attn_lrp" in chosen and has_grid) or pixel_ig else None
    )
    explanation.warnings += grey_image_warning(inputs["pixel_values"], grey)
    image_column = _image_column(model, ids, features)
    if set(ESTIMATES_OF_ANSWERS) & set(chosen):
        explanation.warnings.append("the leave-one-out estimates never remove the image: they score the prompt's words, "
                                    "the image 0")
    if INTEGRATED_GRADIENTS in chosen and not (captioning and pixel_ig):
        explanation.warnings.append(
            "Integrated Gradients scores the prompt's words with the image held (its tokens keep their ids in the baseline)"
            + (", and the image's patches over the pixels against a grey image with the prompt held" if pixel_ig else ", the image 0")
        )
    for name in chosen:
        start = time.perf_counter()
        if name in (*ESTIMATES_OF_ANSWERS, INTEGRATED_GRADIENTS):
            if name == INTEGRATED_GRADIENTS:
                words = torch.zeros_like(ids, dtype=torch.float) if captioning else answer_integrated_gradients(
                    model, ids, answer_ids[None], ig_steps, inputs)
            else:
                keep = special_tokens(ids, tokenizer) | _per_token_flags(template, ids)
                words = _prompt_estimates(model, ids, answer_ids, keep, name != ESTIMATES, inputs)
            summed, patches = _feature_scores(words, features, image_column)[0], None
            if name == INTEGRATED_GRADIENTS and pixel_ig:
                assert grey is not None  # made for it above
                patches = caption_integrated_gradients(
                    model, inputs["pixel_values"], answer_ids[None], grey, ig_steps, ids, prompt_token_inputs(inputs, ids.shape[1])
                )[0]
                summed[image_column] = patches.sum()
            _add_method(explanation, _display(name), SIGNED, start, summed, grid=patches)
            continue
        explainer = registered_method(name, model)
        span = prompt_scores(model, explainer.attribute_span(ids, answer_ids[None], additional_forward_args=args))
        rows = prompt_scores(
            model, explainer.attribute_continuation(ids, answer_ids[None], additional_forward_args=args, log_prob=True)
        ) if per_token else None
        _add_method(
            explanation, _display(name), MethodInfo.of(explainer), start, _feature_scores(span, features, image_column)[0],
            None if rows is None else _feature_scores(rows, features, image_column)[0],
            image_scores(model, ids, span, inputs)[0][0] if has_grid else None,
            image_scores(model, ids, rows, inputs)[0][0] if has_grid and rows is not None else None,
        )
        if name == "attn_lrp" and grey is not None and not cross_attends_images(model) and _pixels_on_grid(model, grey, inputs):
            _add_pixels(explanation, explainer, ids, answer_ids, args, features, grey, per_token)
    if explanation.image_grids:
        grid = next(iter(explanation.image_grids.values()))
        explanation.grid_covers_image = grid_over_image(grid, image.size, getattr(processor, "image_processor", None))
    return explanation


def explain_caption(
    model: Any,
    tokenizer: Any,
    image_processor: Any,
    image_path: str,
    target: str | None = None,
    max_new_tokens: int = 20,
    methods: list[str] | None = None,
    per_token: bool = False,
    ig_steps: int = 50,
) -> AnswerExplanation:
    """An image captioner's caption of the image at ``image_path`` (an image encoder before
    a text decoder, ``VisionEncoderDecoderModel``: it reads no prompt), generated greedily
    or given (``target``), explained by each method over the image's patches: their summed
    score as the one prompt token ``<image>``, and their scores on the encoder's patch
    grid, for the whole caption and (``per_token``) for each of its tokens.
    ``integrated_gradients`` runs Captum's ``IntegratedGradients`` on the pixels against a
    uniform grey image of the same size through the same processor (``ig_steps`` steps),
    summed per patch (:func:`~captum_attention.pixel_scores`), for the whole caption."""
    from PIL import Image

    chosen = methods or list(METHODS)
    check_methods(chosen, answers=True, one_stack=False)
    image = Image.open(image_path).convert("RGB")
    pixels, grey = caption_pixels(model, image_processor, image)
    answer_ids = caption_ids(model, tokenizer, pixels, target, max_new_tokens, "the target")
    explanation = AnswerExplanation(
        prompt_tokens=[IMAGE_TOKEN], special=[False], answer_tokens=readable_tokens(answer_ids, tokenizer),
        answer=tokenizer.decode(answer_ids), generated=target is None, image=str(image_path),
        warnings=(_cut_warning(model, tokenizer, answer_ids, max_new_tokens) if target is None else [])
        + grey_image_warning(pixels, grey if INTEGRATED_GRADIENTS in chosen else None),
    )
    for name in chosen:
        start = time.perf_counter()
        if name == INTEGRATED_GRADIENTS:
            summed = caption_integrated_gradients(model, pixels, answer_ids[None], grey, ig_steps)[0]
            _add_method(explanation, _display(name), SIGNED, start, summed.sum()[None], grid=summed)
            continue
        explainer = registered_method(name, model)
        patches = explainer.attribute_span(pixels, answer_ids[None])[0][0]
        rows = explainer.attribute_continuation(pixels, answer_ids[None], log_prob=True)[0][0] if per_token else None
        _add_method(explanation, _display(name), MethodInfo.of(explainer), start, patches.sum()[None],
                    None if rows is None else rows.sum(dim=(-2, -1))[:, None], patches, rows)
    explanation.grid_covers_image = grid_over_image(next(iter(explanation.image_grids.values())), image.size, image_processor)
    return explanation


def grid_over_image(grid: list[list[float]], size: tuple[int, int], image_processor: Any) -> bool:
    """Whether a grid of scores (rows of columns) can be laid over the whole image of
    ``size``: :func:`shape_over_image` of its shape."""
    return shape_over_image((len(grid), len(grid[0])), size, image_processor)


def shape_over_image(shape: tuple[int, int], size: tuple[int, int], image_processor: Any) -> bool:
    """Whether a grid of ``shape`` (rows, columns) can be laid over the whole image of
    ``size`` (width, height): where ``image_processor`` gives one image's pixels, whether it keeps the whole
    image, to within half a cell at each edge (:func:`keeps_whole_image`: ViT's processor,
    which resizes a photo to a square, does; DeiT's and DINOv2's, which crop even a square
    image's borders, and CLIP's, which crops a wide one, do not); else whether the grid's
    shape follows the image's (:func:`~captum_attention.attr._images.grid_follows_image`)."""
    rows, columns = shape
    whole = None if image_processor is None else keeps_whole_image(image_processor, size, 0.5 / rows, 0.5 / columns)
    return grid_follows_image(shape, size) if whole is None else whole


def keeps_whole_image(image_processor: Any, size: tuple[int, int], row_margin: float, column_margin: float) -> bool | None:
    """Whether ``image_processor`` keeps the whole of an image of ``size`` (width, height):
    grey ramps across it, from black at one edge to white at the other, come out reaching
    within ``column_margin`` (``row_margin``) of their ends at the processed image's edges,
    each pixel read between the processed black and white images (whatever the processor's
    scaling and normalisation). One that crops the image's borders does not, nor one that
    pads it (its padding's pixels are the same whatever the image). None where the
    processor gives anything but one image's pixels (tiles, flattened patches)."""
    import numpy as np
    from PIL import Image

    width, height = size

    def processed(values: Any) -> torch.Tensor:
        picture = Image.fromarray(np.asarray(values, dtype=np.uint8)).convert("RGB")
        return image_processor(images=picture, return_tensors="pt")["pixel_values"].double()

    black, white = processed(np.zeros((height, width))), processed(np.full((height, width), 255))
    if black.dim() != 4 or len(black) != 1:
        return None
    contrast = white - black
    read = contrast.abs() > 1e-6  # padding reads nothing of the image
    if not bool(read[..., :, [0, -1]].all() and read[..., [0, -1], :].all()):
        return False
    across = (processed(np.linspace(0, 255, width)[None].repeat(height, 0)) - black) / contrast
    down = (processed(np.linspace(0, 255, height)[:, None].repeat(width, 1)) - black) / contrast
    first_column, last_column = across[..., 0].mean().item(), across[..., -1].mean().item()
    first_row, last_row = down[..., 0, :].mean().item(), down[..., -1, :].mean().item()
    return first_column <= column_margin and last_column >= 1 - column_margin and first_row <= row_margin and last_row >= 1 - row_margin


def caption_pixels(model: Any, image_processor: Any, image: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """An image captioner's ``pixel_values`` ``(1, channels, height, width)`` of the PIL
    ``image``, and those of a uniform grey image of its size through the same processor:
    the baseline its Integrated Gradients start from and its removed patches take."""
    return processed_pixels(model, image_processor, image), grey_pixels(model, image_processor, image.size)


def grey_pixels(model: Any, image_processor: Any, size: tuple[int, int]) -> torch.Tensor:
    """The ``pixel_values`` of a uniform grey image of ``size`` (width, height) through
    ``image_processor``: the reference a removed patch takes."""
    from PIL import Image

    return processed_pixels(model, image_processor, Image.new("RGB", size, (128, 128, 128)))


def processed_pixels(model: Any, image_processor: Any, picture: Any) -> torch.Tensor:
    return image_processor(images=picture, return_tensors="pt")["pixel_values"].to(model.device, model.dtype)


def caption_prompt(model: Any, tokenizer: Any) -> torch.Tensor | None:
    """``(1, n)`` the tokens a vision-language captioner reads before its caption, as its
    ``generate`` reads them (GIT's [CLS], BLIP's start token: an empty prompt's,
    :func:`~captum_attention.capture.adapters.images.prompt_as_generated`); None for an image
    encoder before a text decoder, which reads its start token."""
    if not image_outside_prompt(model):
        return None
    return prompt_as_generated(model, _empty_prompt(model, tokenizer))[0]


def _empty_prompt(model: Any, tokenizer: Any) -> torch.Tensor:
    """``(1, n)`` the ids an empty prompt's processor gives (BLIP's and GIT's [CLS] [SEP])."""
    return tokenizer("", return_tensors="pt")["input_ids"].to(model.device)


def caption_ids(model: Any, tokenizer: Any, pixels: torch.Tensor, caption: str | None, max_new_tokens: int, given: str) -> torch.Tensor:
    """The ``(n,)`` token ids of the ``caption`` (``given``: what the error calls it), or of
    the caption generated greedily from ``pixels`` (after the decoder's start token; a
    vision-language captioner's after :func:`caption_prompt`); a ``ValueError`` where it is
    longer than the model takes or has no tokens."""
    prompt = caption_prompt(model, tokenizer)
    too_long = answer_too_long(model, tokenizer, 0 if prompt is None else prompt.shape[1], caption, max_new_tokens, given)
    if too_long is not None:
        raise ValueError(too_long)
    if caption is not None:
        ids = torch.tensor(tokenizer(caption, add_special_tokens=False)["input_ids"], dtype=torch.long, device=pixels.device)
    elif prompt is None:
        with torch.no_grad():
            ids = model.generate(pixel_values=pixels, max_new_tokens=max_new_tokens, do_sample=False, **CHOSEN_END)[0, 1:]
    else:
        empty = _empty_prompt(model, tokenizer)
        ids = image_answer_ids(model, tokenizer, empty, torch.ones_like(empty), {"pixel_values": pixels}, None, max_new_tokens)
    if ids.numel() == 0:
        raise ValueError(f"The caption has no tokens: give a non-empty {given.removeprefix('the ')}, or generate at least one token.")
    return ids


def caption_patch_scores(explainer: Any, pixels: torch.Tensor, caption: torch.Tensor, prompt: torch.Tensor | None) -> torch.Tensor:
    """``(1, rows, columns)`` a method's scores of the image's patches for the whole
    ``caption`` ``(1, n)`` of ``pixels``: an image encoder before a text decoder's
    (``prompt`` None) as ``attribute_span`` gives them; a vision-language captioner's, read
    after ``prompt``, its image's on their grid (:func:`~captum_attention.image_scores`),
    detached."""
    if prompt is None:
        return explainer.attribute_span(pixels, caption)[0].detach()
    inputs = {"pixel_values": pixels}
    return first_image_grid(explainer.model, prompt, answer_span(explainer, prompt, caption, inputs), inputs)


def first_image_grid(model: Any, ids: torch.Tensor, span: Any, image_inputs: dict[str, Any]) -> torch.Tensor:
    """``(1, rows, columns)`` the scores of an answer's ``span`` (one example's) of the first
    image's tokens on their grid (:func:`~captum_attention.image_scores`), detached."""
    return image_scores(model, ids, span, image_inputs)[0][0][None].detach()


def caption_integrated_gradients(
    model: Any, pixels: torch.Tensor, caption: torch.Tensor, baseline: torch.Tensor, steps: int, prompt: torch.Tensor | None = None,
    prompt_inputs: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Captum's ``IntegratedGradients`` of the whole ``caption``'s ``(1, n)``
    log-probability over an image captioner's ``pixels`` ``(1, channels, height, width)``
    against ``baseline`` pixels, ``steps`` steps (its decoder reads its start token and the
    caption; a vision-language captioner's language model ``prompt``, :func:`caption_prompt`,
    with its per-token ``prompt_inputs``, and the caption), summed per patch of its image
    encoder (:func:`~captum_attention.pixel_scores`): ``(1, rows, columns)``, detached."""
    from captum.attr import IntegratedGradients

    def log_prob(images: torch.Tensor) -> torch.Tensor:
        return read_caption_log_probs(model, images, caption.expand(len(images), -1), prompt, prompt_inputs)

    patches = pixels.shape[-2] * pixels.shape[-1] // int(getattr(image_encoder_config(model.config), "patch_size", 16)) ** 2
    per_batch = max(1, min(steps, IG_TOKENS_PER_BATCH // (patches + caption.shape[1])))
    gradients = IntegratedGradients(log_prob).attribute(pixels, baselines=baseline, n_steps=steps, internal_batch_size=per_batch)
    return torch.stack(pixel_scores(model, gradients.detach()))


def single_image_pixels(model: Any, image_inputs: dict[str, Any], prompt_length: int) -> torch.Tensor | None:
    """The ``(1, channels, height, width)`` pixels of a vision-language model's one image,
    where they are its only image input besides the per-token inputs of its
    ``prompt_length``-token prompt (:func:`prompt_token_inputs`) and its answer follows the
    prompt (not an encoder-decoder's): what an answer's patch metrics grey and its
    Integrated Gradients runs on; None otherwise (tiled or flattened images, more image
    inputs, Florence-2)."""
    pixels = image_inputs.get("pixel_values")
    others = set(image_inputs) - {"pixel_values"} - set(prompt_token_inputs(image_inputs, prompt_length))
    if getattr(model.config, "is_encoder_decoder", False) or others:
        return None
    return pixels if isinstance(pixels, torch.Tensor) and pixels.dim() == 4 and len(pixels) == 1 else None


def prompt_token_inputs(image_inputs: dict[str, Any], prompt_length: int) -> dict[str, torch.Tensor]:
    """The per-token entries of a vision-language model's inputs for a
    ``prompt_length``-token prompt (PaliGemma's and Gemma 3's ``token_type_ids``), which
    the model reads beside the pixels."""
    return {name: value for name, value in image_inputs.items() if is_per_token(value, prompt_length, name)}


def several_stacks(model: Any) -> bool:
    """Whether a vision-language ``model``'s answer is read through more than one attention
    stack: an encoder-decoder's (Florence-2's), or a language model's cross-attending to
    its image (Mllama's)."""
    return bool(getattr(model.config, "is_encoder_decoder", False)) or cross_attends_images(model)


def prompt_scores(model: Any, scores: Any) -> Any:
    """A method's scores of the prompt and the answer, ``(1, [rows,] N + n)``; an
    encoder-decoder's pair of source and target scores as its source's, ``(1, [rows,] N)``."""
    return scores[0] if getattr(model.config, "is_encoder_decoder", False) else scores


def _pixels_on_grid(model: Any, pixels: torch.Tensor, inputs: dict[str, Any]) -> bool:
    """Whether :func:`~captum_attention.pixel_scores` knows the layout of ``pixels``."""
    from ..capture import UnsupportedModelError

    try:
        pixel_scores(model, pixels, inputs)
    except UnsupportedModelError:
        return False
    return True


PIXELS = "AttnLRP → pixels"
"""The report's name for AttnLRP carried through the vision tower."""


def _add_pixels(
    explanation: AnswerExplanation, explainer: Any, ids: torch.Tensor, answer_ids: torch.Tensor, args: tuple,
    features: torch.Tensor, reference: torch.Tensor, per_token: bool,
) -> None:
    """AttnLRP through the vision tower against the ``reference`` pixels: the text tokens'
    scores, the ``<image>`` token's the pixels' summed relevance, and the first image's
    pixels' relevance summed per patch as the grid."""
    start = time.perf_counter()
    options = {"additional_forward_args": args, "through_vision_tower": True, "pixel_baselines": reference}
    tokens, pixels = explainer.attribute_span(ids, answer_ids[None], **options)
    rows = explainer.attribute_continuation(ids, answer_ids[None], log_prob=True, **options) if per_token else None
    image_column = _image_column(explainer.model, ids, features)
    _add_method(
        explanation, PIXELS, SIGNED, start, _feature_scores((pixels, tokens), features, image_column)[0],
        None if rows is None else _feature_scores((rows[1], rows[0]), features, image_column)[0],
        pixel_scores(explainer.model, pixels.detach(), args[1])[0],
    )


def _image_column(model: Any, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """The ``<image>`` feature of the prompt's first image token, ``(1,)`` (the first
    feature where no token stands for the image: BLIP's)."""
    from ..capture.adapters.images import image_token_id

    if image_outside_prompt(model):
        return torch.tensor([0])
    return features[ids[0] == image_token_id(model.config)].argmax(dim=1)[:1]


def _feature_scores(scores: Any, features: torch.Tensor, image_column: torch.Tensor) -> torch.Tensor:
    """``(1, [rows,] features)``: the prompt tokens' scores summed per feature; for a pair
    of ``(image relevance, token scores)`` (Mllama's image states, AttnLRP's pixels), the
    image's summed relevance added to the ``<image>`` feature."""
    image, tokens = scores if isinstance(scores, tuple) else (None, scores)
    summed = tokens[..., : features.shape[0]].detach().float() @ features
    if image is not None:
        summed[..., image_column] += image.detach().float().reshape(*summed.shape[:-1], -1).sum(dim=-1, keepdim=True)
    return summed


def _image_tokens(model: Any, ids: torch.Tensor) -> list[bool]:
    """Per token of ``ids``, whether it is one of the image's."""
    from ..capture.adapters.images import image_token_id

    token_id = image_token_id(model.config)
    return ids.eq(-1 if token_id is None else token_id).tolist()


def image_prompt_inputs(
    processor: Any, prompt: str, image: Any, chat: bool = False, with_image_token: bool = True
) -> tuple[str, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """The processor's inputs for ``prompt`` about the PIL ``image`` (the processor's image
    token put first where the prompt holds none and the model reads one,
    ``with_image_token``: BLIP's reads none; the prompt as it is where the processor
    refuses that because it places the image itself, as Florence-2's does; with ``chat``,
    the image and the prompt as the user's turn in its chat template): the text it read,
    the ids ``(1, N)`` (the image's tokens expanded), the attention mask and the image
    inputs."""
    marker = getattr(processor, "image_token", None) or IMAGE_TOKEN
    if chat:
        text = chat_prompt(processor.tokenizer, [{"type": "image"}, {"type": "text", "text": prompt}], processor)
    else:
        text = prompt if marker in prompt or not with_image_token else f"{marker} {prompt}"
    try:
        inputs = dict(processor(text=text, images=image, return_tensors="pt"))
    except ValueError as marked:
        if text == prompt or chat:
            raise
        try:
            inputs, text = dict(processor(text=prompt, images=image, return_tensors="pt")), prompt
        except ValueError:
            raise marked from None
    ids, mask = inputs.pop("input_ids"), inputs.pop("attention_mask", None)
    return text, ids, torch.ones_like(ids) if mask is None else mask, inputs


def image_answer_too_long(
    model: Any, tokenizer: Any, prompt_tokens: int, answer: str | None, max_new_tokens: int, named: str
) -> str | None:
    """:func:`~captum_attention.presentation.explain.answer_too_long` for a prompt of
    ``prompt_tokens`` tokens as the processor expands them with the image, saying so."""
    too_long = answer_too_long(model, tokenizer, prompt_tokens, answer, max_new_tokens, named)
    return None if too_long is None else f"{too_long} (the image's tokens counted)"


def image_answer_ids(
    model: Any, tokenizer: Any, ids: torch.Tensor, mask: torch.Tensor, inputs: dict[str, Any], target: str | None, max_new_tokens: int
) -> torch.Tensor:
    """``(n,)``: ``target`` tokenized without special tokens, or the model's greedy answer
    to the processor's prompt ``ids`` with its image ``inputs`` (an encoder-decoder's: its
    decoder's tokens after its start token; BLIP's and GIT's: after the prompt their
    ``generate`` reads, :func:`~captum_attention.capture.adapters.images.generate_inputs`)."""
    if target is not None:
        return with_forced_token(model, torch.tensor(tokenizer(target, add_special_tokens=False)["input_ids"], dtype=torch.long))
    given, given_mask = generate_inputs(model, ids, mask)
    with torch.no_grad():  # a copy of the ids: BLIP's generate writes into the ids it is given
        generated = model.generate(input_ids=given.clone(), attention_mask=given_mask, **inputs, max_new_tokens=max_new_tokens,
                                   do_sample=False, **CHOSEN_END)
    if getattr(model.config, "is_encoder_decoder", False):
        return generated[0, 1:]  # its decoder's, after the start token
    return generated[0, prompt_as_generated(model, ids)[0].shape[1] :]


def image_template_tokens(model: Any, tokenizer: Any, text: str, message: str, ids: torch.Tensor) -> list[bool]:
    """Per token of the processor's ``ids`` (the image's tokens expanded), whether the chat
    template wrote it (:func:`written_by_template` on the templated ``text`` as the
    tokenizer reads it, placed by :func:`on_expanded_tokens`); none where the text tokens
    differ (a processor that adds tokens of its own)."""
    plain = tokenizer(text)["input_ids"]
    marks = on_expanded_tokens(model, plain, written_by_template(tokenizer, text, message, plain), ids, False)
    return [False] * len(ids) if marks is None else marks


def on_expanded_tokens(model: Any, plain: list[int], values: list[Any], ids: torch.Tensor, image_value: Any) -> list[Any] | None:
    """``values``, one per token of a prompt as the tokenizer reads it (``plain``), placed on
    the processor's ``ids`` (the image's tokens expanded): the text tokens matched in
    order, ``image_value`` at the image's; None where the text tokens differ (a processor
    that adds tokens of its own around the image)."""
    is_image = _image_tokens(model, ids)
    image_ids = set(ids[torch.tensor(is_image, dtype=torch.bool)].tolist())
    text = [(token, value) for token, value in zip(plain, values) if token not in image_ids]
    if [token for token, image in zip(ids.tolist(), is_image) if not image] != [token for token, _ in text]:
        return None
    placed = iter(value for _, value in text)
    return [image_value if image else next(placed) for image in is_image]


def _image_features(
    model: Any, ids: torch.Tensor, tokenizer: Any, template: list[bool] | None = None
) -> tuple[torch.Tensor, list[str], list[bool], list[bool]]:
    """``(tokens, features)`` weights, the features' names, whether each is a special
    token, and whether the chat template wrote it (per token: ``template``; none given:
    none): each text token its own feature, each run of image tokens one (``<image>``)."""
    held = _image_tokens(model, ids)
    special_ids = set(tokenizer.all_special_ids)
    names: list[str] = []
    special: list[bool] = []
    written: list[bool] = []
    columns: list[int] = []
    marks = template or [False] * len(ids)
    for token, text, is_image, wrote in zip(ids.tolist(), readable_tokens(ids, tokenizer), held, marks):
        if not (is_image and names and names[-1] == IMAGE_TOKEN):
            names.append(IMAGE_TOKEN if is_image else text)
            special.append(not is_image and token in special_ids)
            written.append(wrote)
        columns.append(len(names) - 1)
    features = torch.zeros(len(ids), len(names))
    features[torch.arange(len(ids)), torch.tensor(columns)] = 1.0
    if image_outside_prompt(model):  # the image first, though no token stands for it (BLIP's)
        return torch.cat([torch.zeros(len(ids), 1), features], dim=1), [IMAGE_TOKEN, *names], [False, *special], [False, *written]
    return features, names, special, written


def _has_grid(model: Any, ids: torch.Tensor, inputs: dict[str, Any]) -> bool:
    """Whether the prompt's first image's tokens have a known grid
    (:func:`~captum_attention.capture.adapters.images.image_token_layout`)."""
    from ..capture.adapters.images import image_token_layout

    (images,) = image_token_layout(model, ids, inputs)
    return bool(images) and images[0].grid is not None
