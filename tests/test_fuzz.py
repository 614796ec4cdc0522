"""Fuzzing the public calls: any shapes, dtypes, masks, targets and options give a correct
result or one clear ``ValueError``/``TypeError``, never another exception."""

from __future__ import annotations

import json

import torch
from conftest import make_model
from constants import NUM_LABELS, VOCAB
from lm_models import make_decoder
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from captum_attention import METHODS
from captum_attention.metrics import (
    attention_erasure,
    comprehensiveness,
    decision_flip_fraction,
    leave_one_out,
    leave_one_out_agreement,
    linear_datamodeling_score,
    perturbation_curve,
    sufficiency,
    top_k_log_prob_drop,
)
from captum_attention.presentation.dataset import DatasetError, read_dataset
from captum_attention.presentation.text import has_surrogates

MODEL = make_model("bert")
DECODER = make_decoder("llama")
CLEAR = (ValueError, TypeError)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Reach:
    """How many of a property test's examples got past the clear errors to its checks: an
    implementation that refused every call with a ``ValueError`` would pass the checks of
    none, and ``assert_share`` fails it."""

    def __init__(self) -> None:
        self.examples = self.checked = 0

    def refused(self) -> None:
        self.examples += 1

    def passed(self) -> None:
        self.examples += 1
        self.checked += 1

    def assert_share(self, minimum: float) -> None:
        assert self.examples and self.checked / self.examples >= minimum, (
            f"{self.checked} of {self.examples} examples reached the checks (at least {minimum:.0%} must)"
        )


DEFECTS = [
    "empty batch", "int32", "bool", "float64", "3d ids", "mask of another shape", "float mask", "all padding",
    "target out of range", "float target", "target list of another length", "query outside", "query on padding",
]
"""What a malformed call gets wrong, one at a time."""


@st.composite
def calls(draw):
    """``(inputs, mask, target, query_index)``: a well-formed call (token ids or embeddings,
    no mask, a right-padded or a random mask, any target and query the call allows) about
    half the time, else a call with one of :data:`DEFECTS`."""
    defect = draw(st.sampled_from([None] * len(DEFECTS) + DEFECTS))
    batch = 0 if defect == "empty batch" else draw(st.integers(1, 3))
    seq_len = draw(st.integers(2, 9))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    ids = torch.randint(1, VOCAB, (batch, seq_len), generator=generator)
    embeddings = torch.randn(batch, seq_len, 32, generator=generator)
    inputs = {
        "int32": ids.int(), "bool": ids > VOCAB // 2, "float64": embeddings.double(), "3d ids": ids[:, :, None],
    }.get(defect or "", draw(st.sampled_from([ids, embeddings])))
    lengths = torch.randint(1, seq_len + 1, (batch,), generator=generator)
    mask = draw(st.sampled_from(["none", "right-padded", "random"]))
    mask = {
        "none": None,
        "right-padded": (torch.arange(seq_len)[None, :] < lengths[:, None]).long(),
        "random": (torch.rand(batch, seq_len, generator=generator) > 0.3).long().index_fill(1, torch.tensor([0]), 1),
    }[mask]
    if defect in ("mask of another shape", "float mask", "all padding", "query on padding"):
        mask = {
            "mask of another shape": torch.ones(batch, seq_len + 1, dtype=torch.long),
            "float mask": torch.rand(batch, seq_len, generator=generator).round(),
            "all padding": torch.zeros(batch, seq_len, dtype=torch.long),
            "query on padding": torch.ones(batch, seq_len, dtype=torch.long).index_fill(1, torch.tensor([seq_len - 1]), 0),
        }[defect]
    target = draw(st.one_of(st.none(), st.integers(0, NUM_LABELS - 1), st.lists(st.integers(0, NUM_LABELS - 1), min_size=batch, max_size=batch)))
    target = {
        "target out of range": NUM_LABELS, "float target": torch.zeros(batch), "target list of another length": [0] * (batch + 1),
    }.get(defect or "", target)
    valid_query = draw(st.one_of(st.none(), st.just(0)))
    query_index = {"query outside": seq_len, "query on padding": seq_len - 1}.get(defect or "", valid_query)
    return inputs, mask, target, query_index


def _check_scores(scores: torch.Tensor, inputs: torch.Tensor, mask: torch.Tensor | None) -> None:
    assert scores.shape == inputs.shape[:2]
    if mask is not None:
        assert bool((scores[mask == 0] == 0).all()), "padding must score 0"


def test_attribute_gives_scores_or_a_clear_error():
    reach = Reach()

    @FUZZ
    @given(call=calls(), name=st.sampled_from(sorted(METHODS)), capture=st.sampled_from(["auto", "eager"]))
    def check(call, name, capture):
        inputs, mask, target, query_index = call
        args = None if mask is None else (mask,)
        try:
            scores = METHODS[name](MODEL, capture=capture).attribute(
                inputs, target=target, additional_forward_args=args, query_index=query_index
            )
        except CLEAR:
            reach.refused()
            return
        _check_scores(scores, inputs, mask)
        reach.passed()

    check()
    reach.assert_share(0.3)  # 0.47-0.69 over 30 seeds: half the calls are malformed


def test_metrics_give_results_or_a_clear_error():
    reach = Reach()

    @FUZZ
    @given(
        call=calls(),
        layers=st.one_of(st.none(), st.integers(-3, 2), st.lists(st.integers(-3, 2), min_size=1, max_size=3), st.integers(-5, 4)),
        heads=st.one_of(st.none(), st.lists(st.integers(-4, 3), min_size=1, max_size=3), st.lists(st.integers(-6, 5), max_size=3)),
        nan=st.sampled_from([False, False, True]),
        seed=st.integers(0, 2**16),
    )
    def check(call, layers, heads, nan, seed):
        inputs, mask, _, _ = call
        args = None if mask is None else (mask,)
        keys = torch.zeros(inputs.shape[:2], dtype=torch.bool)
        if keys.numel():
            keys[:, 0] = True
        ranking = torch.rand(inputs.shape[:2], generator=torch.Generator().manual_seed(seed))
        if nan and ranking.numel():
            ranking[0, 0] = float("nan")
        try:
            erased = attention_erasure(MODEL, inputs, keys, args, layers=layers, heads=heads)
            flips = decision_flip_fraction(MODEL, inputs, ranking, args, layers=layers, heads=heads)
        except CLEAR:
            reach.refused()
            return
        assert bool(((erased.js_divergence >= 0) & (erased.js_divergence <= 1)).all())
        assert flips.removed.shape == (inputs.shape[0],)
        reach.passed()

    check()
    reach.assert_share(0.15)  # 0.29-0.53 over 70 seeds: half the calls are malformed, most layer and head lists invalid, a third NaN


def test_token_removal_metrics_give_results_or_a_clear_error():
    """Any attribution (NaN, ±inf included), any mask and any ``keep``: finite values, or one
    clear error; never an all-padding row explained, and nothing removed when every token
    is kept."""
    reach = Reach()

    @settings(max_examples=150, deadline=None)
    @given(
        call=calls(),
        special=st.sampled_from([0.0, 0.0, 0.0, 0.0, float("nan"), float("inf"), float("-inf")]),
        keep_all=st.sampled_from([False, False, False, True]),
        metric=st.sampled_from(["comprehensiveness", "sufficiency", "perturbation_curve", "leave_one_out"]),
        seed=st.integers(0, 2**16),
    )
    def check(call, special, keep_all, metric, seed):
        inputs, mask, target, _ = call
        if inputs.is_floating_point() or inputs.dim() != 2:
            inputs = torch.zeros(inputs.shape[:2], dtype=torch.long) + 5
        mask = torch.ones_like(inputs) if mask is None or mask.shape != inputs.shape else mask.long()
        scores = torch.rand(inputs.shape, generator=torch.Generator().manual_seed(seed))
        if scores.numel():
            scores[0, -1] = special
        keep = torch.ones_like(inputs, dtype=torch.bool) if keep_all else None
        originally_empty = (mask == 0).all(dim=1)
        seen: list[torch.Tensor] = []

        def forward(ids, attention_mask):
            seen.append(attention_mask)
            return MODEL(input_ids=ids, attention_mask=attention_mask).logits

        try:
            if metric == "leave_one_out":
                values = leave_one_out(forward, inputs, mask, target, keep=keep)
                assert values.shape == inputs.shape
            else:
                function = {"comprehensiveness": comprehensiveness, "sufficiency": sufficiency, "perturbation_curve": perturbation_curve}[metric]
                result = function(forward, inputs, mask, scores, target, keep=keep)
                values = result.target_prob if metric == "perturbation_curve" else result
                assert bool(torch.isfinite(values).all())
        except CLEAR:
            reach.refused()
            return
        assert not bool(originally_empty.any()), "an all-padding row was explained"
        if keep_all:
            assert len(seen) <= 1, "every token is kept: nothing may be removed"
        reach.passed()

    check()
    reach.assert_share(0.25)  # about half on average: half the calls are malformed, and most non-finite scores are refused


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=True) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["text", "label", "rationale", "x"]), inner, max_size=4),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(
        st.one_of(
            st.builds(lambda v: json.dumps(v), _JSON_VALUES),
            st.builds(lambda v: json.dumps({"text": v}), st.text(max_size=8)),
            st.text(max_size=12),
            st.just('{"text": "\\ud800 film"}'),
        ),
        max_size=5,
    ),
    suffix=st.sampled_from([".jsonl", ".csv"]),
    skip=st.booleans(),
)
def test_the_data_reader_gives_examples_or_one_clear_error(tmp_path_factory, rows, suffix, skip):
    """evaluate's reader on arbitrary JSON, text and CSV rows: examples whose text is real
    Unicode with something visible in it, or a ``DatasetError`` naming the problem."""
    path = tmp_path_factory.mktemp("data") / f"rows{suffix}"
    path.write_text("\n".join(rows), encoding="utf-8", errors="surrogatepass")
    try:
        examples, skipped = read_dataset(path, skip_malformed=skip)
    except DatasetError as error:
        assert "\n" not in str(error)
        return
    assert examples and all(isinstance(e.text, str) and e.text.strip() and not has_surrogates(e.text) for e in examples)
    # a class index, or a label's name (kept as text until the model's labels map it)
    assert all(e.label is None or isinstance(e.label, int) or (isinstance(e.label, str) and e.label) for e in examples)
    assert [e.index for e in examples] == list(range(len(examples)))
    assert skip or not skipped


def test_context_metrics_give_results_or_a_clear_error():
    """Any prompts (empty ones included), answers, attributions (NaN, ±inf) and segments:
    values in their range, or one clear error; never an ablation that leaves no prompt token."""
    reach = Reach()

    @settings(max_examples=100, deadline=None)
    @given(
        lengths=st.lists(st.sampled_from([3, 5, 6, 4, 1, 0]), min_size=1, max_size=3).filter(lambda lengths: max(lengths) > 0),
        answer_len=st.sampled_from([1, 2, 1, 2, 0]),
        special=st.sampled_from([0.0, 0.0, 0.0, 0.0, float("nan"), float("inf"), float("-inf")]),
        segment_kind=st.sampled_from(["none", "anchored", "none", "anchored", "random", "no-anchor", "wrong-shape"]),
        metric=st.sampled_from(["top_k", "lds", "loo"]),
        seed=st.integers(0, 2**16),
    )
    def check(lengths, answer_len, special, segment_kind, metric, seed):
        generator = torch.Generator().manual_seed(seed)
        width = max(lengths)
        mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
        ids = torch.randint(3, VOCAB, mask.shape, generator=generator).masked_fill(mask == 0, 0)
        answer = torch.randint(3, VOCAB, (len(lengths), answer_len), generator=generator)
        scores = torch.rand(mask.shape, generator=generator)
        if scores.numel():
            scores[0, -1] = special
        segments = {
            "none": None,
            "anchored": torch.randint(0, 3, mask.shape, generator=generator).index_fill(1, torch.tensor([width - 1]), -1),
            "random": torch.randint(-1, 3, mask.shape, generator=generator),
            "no-anchor": torch.randint(0, 3, mask.shape, generator=generator),
            "wrong-shape": torch.zeros(len(lengths), width + 1, dtype=torch.long),
        }[segment_kind]
        seen: list[torch.Tensor] = []

        def forward(input_ids, attention_mask):
            seen.append(attention_mask)
            return DECODER(input_ids=input_ids, attention_mask=attention_mask).logits

        try:
            if metric == "top_k":
                values = top_k_log_prob_drop(forward, ids, mask, answer, scores, segments=segments)
                assert bool(torch.isfinite(values).all())
            elif metric == "lds":
                values = linear_datamodeling_score(forward, ids, mask, answer, scores, segments, num_ablations=4, seed=seed)
                assert bool(((values.abs() <= 1 + 1e-6) | values.isnan()).all())
            else:
                values = leave_one_out_agreement(forward, ids, mask, answer, scores, segments)
                assert bool(((values.abs() <= 1 + 1e-6) | values.isnan()).all())
            assert values.shape[0] == len(lengths)
        except CLEAR:
            reach.refused()
            return
        prompt_len = ids.shape[1]
        assert all(bool((m[:, :prompt_len].sum(dim=1) > 0).all()) for m in seen), "an ablation left no prompt token"
        reach.passed()

    check()
    reach.assert_share(0.15)
