"""The model is left as found when a call is interrupted, and when two threads share it.

An asynchronous ``KeyboardInterrupt`` (what Ctrl-C raises) is fired by a timer at a random
moment of each call; after every call the model's hooks, attention implementation,
training flags, ``requires_grad``, parameters and ``.grad`` must be exactly as before, and
transformers' attention registry must hold its own ``sdpa`` function again.
``CAPTUM_ATTENTION_INTERRUPTS`` sets the number of calls per capture mode (default 300,
about 5 s; the methods of one group, and erasure, in turn).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections import deque
from functools import partial
import signal
import threading

import pytest
import torch
from conftest import assert_same_state, make_batch, make_model, model_state
from lm_models import make_decoder, make_encoder_decoder

from captum_attention import ALTI, METHODS, DecompX, ValueZeroing
from captum_attention.attr import REGISTRY
from captum_attention._compat import attention_function, function_mode_stack, implementation_owner
from captum_attention.metrics import attention_erasure

CALLS = int(os.environ.get("CAPTUM_ATTENTION_INTERRUPTS", "300"))
RE_RUNNING = {"decompx": DecompX, "value_zeroing": ValueZeroing, "alti": ALTI, "sensitivity": partial(DecompX, multiply_by_inputs=False)}
"""The methods that re-run the model or its layers with hooks of their own, and DecompX's sensitivity."""


def _options(name: str, index: int) -> dict:
    """The attribute options of call ``index`` of method ``name``: the norms with and
    without the residual in turn."""
    return dict(residual=index % 2 == 0) if name == "norm_attention" else {}


class _Interrupt:
    """Raises ``KeyboardInterrupt`` in the main thread after ``delay`` seconds (SIGALRM)."""

    def __enter__(self) -> "_Interrupt":
        self.armed = False
        self.previous = signal.signal(signal.SIGALRM, self._fire)
        return self

    def _fire(self, signum, frame):
        if self.armed:
            raise KeyboardInterrupt

    def arm(self, delay: float) -> None:
        self.armed = True
        signal.setitimer(signal.ITIMER_REAL, delay)

    def disarm(self) -> None:
        self.armed = False  # first: a timer already due now does nothing
        signal.setitimer(signal.ITIMER_REAL, 0)

    def __exit__(self, *exc_info) -> None:
        self.disarm()
        signal.signal(signal.SIGALRM, self.previous)


def _timed_call(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _classifier_calls(methods: str, capture: str):
    """A BERT classifier and, per call index, a call of one method in turn."""
    model = make_model("bert")
    batch = make_batch(model)
    args = dict(target=1, additional_forward_args=(batch.attention_mask,))
    classes = {
        "reported": dict(METHODS),
        "re-running": RE_RUNNING,
        "the others": {name: cls for name, cls in REGISTRY.items() if name not in {*METHODS, *RE_RUNNING, "alti_logit"}},
    }[methods]
    names = sorted(classes)

    def call(index: int):
        name = names[index % len(names)]
        if index % 5 == 4 and methods == "reported":
            erased = torch.zeros_like(batch.attention_mask, dtype=torch.bool)
            erased[:, 1] = True
            return lambda: attention_erasure(model, batch.input_ids, erased, (batch.attention_mask,), capture=capture)
        explainer = classes[name](model, capture=capture)
        return lambda: explainer.attribute(batch.input_ids, **args, **_options(name, index))

    return model, call


def _answer_calls(capture: str, encoder_decoder: bool):
    """A Llama causal LM (one prompt left-padded) or a BART (one prompt right-padded) and,
    per call index, a two-token answer's span explained by each method that explains that
    model's answers, in turn."""
    model = make_encoder_decoder("bart") if encoder_decoder else make_decoder("llama")
    generator = torch.Generator().manual_seed(0)
    prompts, answer = torch.randint(3, 20, (2, 8), generator=generator), torch.randint(3, 20, (2, 2), generator=generator)
    mask = torch.ones_like(prompts)
    mask[1, slice(-2, None) if encoder_decoder else slice(0, 2)] = 0
    names = sorted(
        name for name, cls in REGISTRY.items() if name != "attention_flow" and (cls.spec.encoder_decoder or not encoder_decoder)
    )

    def call(index: int):
        name = names[index % len(names)]
        explainer = REGISTRY[name](model, capture=capture)
        return lambda: explainer.attribute_span(prompts, answer, additional_forward_args=(mask,), **_options(name, index))

    return model, call


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs POSIX interval timers")
@pytest.mark.parametrize("methods", ["reported", "re-running", "the others", "answers", "encoder-decoder answers"])
@pytest.mark.parametrize("capture", ["auto", "eager"])
def test_interrupted_calls_leave_the_model_as_found(capture, methods):
    """The reported methods and erasure in turn; the methods that re-run the model or its
    layers with hooks of their own (DecompX's forward on the shares, Value Zeroing's and
    ALTI's re-runs of each layer) and DecompX's sensitivity (its forward's held backward,
    a zero offset on each bias) in turn; every other registered method in turn (the norms'
    hooks on the output projections among them); and every method that explains a causal
    LM's or an encoder-decoder's answer, each on a two-token span."""
    if methods.endswith("answers"):
        model, call = _answer_calls(capture, encoder_decoder=methods.startswith("encoder-decoder"))
    else:
        model, call = _classifier_calls(methods, capture)
    sdpa = attention_function("sdpa")
    config_property = vars(implementation_owner(type(model.config)))["_attn_implementation"]

    # the timer fires within the typical call's time, the median of the last 10 whole calls:
    # a load on the machine that comes or goes during the test moves it along
    durations = deque((_timed_call(call(i)) for i in range(10)), maxlen=10)
    before = model_state(model)
    sigint = signal.getsignal(signal.SIGINT)
    rng = random.Random(0)
    interrupted = 0
    with _Interrupt() as interrupt:
        for index in range(CALLS):
            run = call(index)
            try:
                interrupt.arm(rng.uniform(1e-5, statistics.median(durations)))
                start = time.perf_counter()
                run()
                interrupt.disarm()
                durations.append(time.perf_counter() - start)
            except KeyboardInterrupt:
                interrupt.disarm()
                interrupted += 1
            assert_same_state(before, model_state(model))
            assert attention_function("sdpa") is sdpa
            assert vars(implementation_owner(type(model.config)))["_attn_implementation"] is config_property
            assert torch.is_grad_enabled() and not function_mode_stack(), "torch's global modes restored"
            assert signal.getsignal(signal.SIGINT) is sigint, "the guard left its handler behind"
            assert signal.getsignal(signal.SIGALRM) == interrupt._fire, "the guard left its handler behind"
    assert interrupted > CALLS // 4, "the timer should interrupt a good share of the calls"


def test_two_threads_on_one_model_both_get_the_single_thread_result():
    """Every registered method that explains a classifier, the ones that re-run layers or
    hook the output projections among them."""
    model = make_model("bert")
    batch = make_batch(model)
    before = model_state(model)
    explainers = {name: cls(model) for name, cls in REGISTRY.items() if name != "alti_logit"}
    args = dict(target=1, additional_forward_args=(batch.attention_mask,))
    expected = {name: e.attribute(batch.input_ids, **args) for name, e in explainers.items()}
    failures: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(30):
                name = rng.choice(sorted(explainers))
                torch.testing.assert_close(explainers[name].attribute(batch.input_ids, **args), expected[name])
        except BaseException as error:  # noqa: BLE001 - reported below
            failures.append(error)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[0]
    assert_same_state(before, model_state(model))
