"""What keeps a capture's changes to the model whole: interrupts held back while the model
is being changed or restored, and one capture of a model at a time.

A capture changes the model for the length of one call (hooks, the attention
implementation) and restores it on exit. Two things could break that promise:

- an asynchronous signal handler raising in the middle of the set-up or the tear-down
  (Ctrl-C's ``KeyboardInterrupt`` can land between any two bytecodes);
- a second thread changing or restoring the same model at the same time.

:class:`InterruptGuard` holds back the first while the interrupted code is in one of the
capture's protected functions and delivers it once the model is restored;
:func:`model_lock` serialises the second. :class:`ScopedFunctionMode` is a
``TorchFunctionMode`` that an interrupt cannot strand off torch's mode stack.
:func:`every_forward` runs a hook at every call of a module's forward, also a direct one
past the module's hooks. :func:`ctrl_c_noticed` tells a long loop (an evaluation, a fit)
that Ctrl-C came even where Python swallowed its ``KeyboardInterrupt``, so that the loop
still stops.
"""

from __future__ import annotations

import signal
import sys
import threading
import weakref
from contextlib import ExitStack, contextmanager
from functools import wraps
from types import CodeType, FrameType
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .._compat import SOFTMAXES, attention_softmax, function_mode_stack, restore_popped_mode

SignalHandler = Callable[[int, FrameType | None], Any]


class InterruptGuard:
    """Holds back signals that land in protected code and delivers them when removed.

    While installed, every signal with a Python handler (``KeyboardInterrupt`` for
    SIGINT, or any handler the program set) goes through the guard: if the interrupted
    frame, or any frame that called it, runs one of the ``protected`` code objects, the
    signal is held; anywhere else (the model's forward, the user's code) its handler runs
    at once, as without the guard. :meth:`remove` restores the handlers and then runs the
    held ones, so their exceptions surface after the protected code finished.

    Python runs signal handlers in the main thread only, so elsewhere the guard does
    nothing (and nothing needs it).

    Args:
        protected (frozenset of code objects): the functions that must run whole.
    """

    def __init__(self, protected: frozenset[CodeType]) -> None:
        self.protected = protected
        self._previous: dict[int, SignalHandler] = {}
        self._held: list[int] = []

    def install(self) -> None:
        """Route the Python-handled signals through the guard (main thread only), all or
        nothing: a signal whose handler raises while the handlers are being swapped gets
        every handler restored first (see :meth:`remove`), then its exception."""
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            for signum in signal.valid_signals():
                handler = signal.getsignal(signum)
                if callable(handler):
                    self._previous[signum] = handler
                    signal.signal(signum, self._guarded)
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Restore every handler, then run those of the held signals. A signal whose
        handler is already restored may still raise while the others are restored: its
        exception is raised again once all handlers are back."""
        interrupted: BaseException | None = None
        remaining = list(self._previous.items())
        while remaining:
            try:
                while remaining:
                    signum, handler = remaining[-1]
                    signal.signal(signum, handler)
                    remaining.pop()
            except BaseException as error:  # raised by a signal handler: restore the rest first
                interrupted = interrupted or error
        previous, self._previous = self._previous, {}
        try:
            self.deliver_held(previous)
        finally:
            if interrupted is not None:
                raise interrupted

    def deliver_held(self, handlers: dict[int, SignalHandler] | None = None) -> None:
        """Run the handlers of the signals held so far (e.g. while waiting for a lock,
        before anything was changed)."""
        handlers = self._previous if handlers is None else handlers
        held, self._held = self._held, []
        for signum in held:
            handlers[signum](signum, sys._getframe())

    def _guarded(self, signum: int, frame: FrameType | None) -> None:
        caller = frame
        while caller is not None:
            if caller.f_code in self.protected:
                self._held.append(signum)
                return
            caller = caller.f_back
        handler = self._previous.get(signum, signal.default_int_handler)
        handler(signum, frame)


class SharedPatch:
    """A process-wide replacement, installed while at least one capture holds it.

    The first :meth:`acquire` saves what ``read()`` returns and writes the
    replacement; the last :meth:`release` writes the saved value back, unless something
    else was written in the meantime (a user's own registration is kept, not reverted).
    The replacement itself dispatches on a context variable, so threads and contexts
    without a capture run :attr:`original` as if nothing were there (it stays set after
    the release, for a call that looked the replacement up just before).

    Args:
        read (callable): returns what is installed now.
        write (callable): installs a value.
        replacement: what is installed while held.
    """

    def __init__(self, read: Callable[[], Any], write: Callable[[Any], None], replacement: Any) -> None:
        self.read, self.write, self.replacement = read, write, replacement
        self.original: Any = None
        self._holders = 0
        self._lock = threading.Lock()

    def acquire(self) -> None:
        with self._lock:
            if self._holders == 0:
                self.original = self.read()
                self.write(self.replacement)
            self._holders += 1

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                if self.read() is self.replacement:
                    self.write(self.original)


_LOCKS: "weakref.WeakKeyDictionary[nn.Module, threading.RLock]" = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


@torch.compiler.disable
def current_thread() -> int:
    """This thread's identifier, by which a capture's hooks tell the capturing thread's
    forward from another thread's. Run outside ``torch.compile``'s tracing, which cannot
    trace :func:`threading.get_ident` (it warned, and broke the graph all the same)."""
    return threading.get_ident()


def model_lock(model: nn.Module) -> threading.RLock:
    """The lock a capture of ``model`` holds while it has the model changed (re-entrant,
    so a thread may nest captures of one model)."""
    with _LOCKS_LOCK:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


@contextmanager
def ctrl_c_noticed() -> Iterator[Callable[[], bool]]:
    """Whether Ctrl-C came while the block ran, even if its ``KeyboardInterrupt`` never
    reached the block: raised inside a finaliser or a garbage collector's callback, Python
    can only report it there. Only the main thread hears signals; elsewhere, or where
    SIGINT has no Python handler, this never reports one."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(previous):
        yield lambda: False
        return
    noticed: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        noticed.append(signum)
        previous(signum, frame)

    signal.signal(signal.SIGINT, handler)
    try:
        yield lambda: bool(noticed)
    finally:
        signal.signal(signal.SIGINT, previous)


class ScopedFunctionMode(TorchFunctionMode):
    """A ``TorchFunctionMode`` whose exit finds it where an interrupt left it.

    torch pops a mode while its handler runs; an interrupt landing in that window can
    leave it off the stack (see :func:`~captum_attention._compat.restore_popped_mode`).
    On exit the mode is put back first if so, and popped only if it is there.
    """

    def __exit__(self, *exc_info: Any) -> None:
        if not any(mode is self for mode in function_mode_stack()):
            restore_popped_mode(self)  # an interrupt inside torch's dispatch stranded it popped
        if any(mode is self for mode in function_mode_stack()):
            super().__exit__(*exc_info)


class ClampedSoftmax(ScopedFunctionMode):
    """Every softmax taken as :func:`~captum_attention._compat.attention_softmax` takes an
    attention's: a float64 model run outside a capture (a check before it) gives what it
    gives inside one, where transformers' eager softmax in float32 would give NaN. Only
    scores below float32's least value change, and only rows of nothing but those."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in SOFTMAXES:
            return attention_softmax(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


ForwardPreHook = Callable[[nn.Module, tuple, dict], "tuple[tuple, dict] | None"]


@contextmanager
def every_forward(module: nn.Module, hook: ForwardPreHook) -> Iterator[None]:
    """``hook(module, args, kwargs)`` run at every call of ``module``'s forward, as a
    forward pre-hook with keyword arguments runs, and returning new ``(args, kwargs)`` or
    None as it may, also where the forward is called directly (``module.forward(...)``:
    sentence-transformers calls its model so, past every hook). The instance's own
    ``forward`` (accelerate's) is wrapped, and put back on exit."""
    own = vars(module).get("forward")
    forward_call = module.forward

    @wraps(forward_call)  # its signature stays readable
    def forward(*args: Any, **kwargs: Any) -> Any:
        changed = hook(module, args, kwargs)
        if changed is not None:
            args, kwargs = changed
        return forward_call(*args, **kwargs)

    vars(module)["forward"] = forward
    try:
        yield
    finally:
        if vars(module).get("forward") is forward:
            if own is None:
                del vars(module)["forward"]
            else:
                vars(module)["forward"] = own


_Changes = TypeVar("_Changes", bound="ModelChanges")


class ModelChanges:
    """Context manager: ``install(stack)`` changes ``model`` (hooks, function modes, its
    attention implementation), and ``stack`` undoes it on exit; both run whole under
    interrupts (an :class:`InterruptGuard` holds them back there) and one thread at a time
    (:func:`model_lock`), as a capture's set-up and tear-down do.

    Args:
        model: the model changed.
        install: enters every change into the ``ExitStack`` it is given.
    """

    def __init__(self, model: nn.Module, install: Callable[[ExitStack], None]) -> None:
        self.model, self.install = model, install
        self._guard = InterruptGuard(_MODEL_CHANGES)
        self._lock = model_lock(model)
        self._stack = ExitStack()
        self._entered = False

    def __enter__(self: _Changes) -> _Changes:
        if self._entered:  # a second install would take the place of the first, whose changes no exit could undo
            raise RuntimeError(f"This {type(self).__name__} is already open: nest another one, not the same one twice.")
        self._guard.install()
        try:
            while not self._lock.acquire(timeout=0.05):
                self._guard.deliver_held()  # nothing changed yet: an interrupt while waiting is delivered
            try:
                with ExitStack() as stack:
                    stack.callback(graph_cutter(self.model))
                    self.install(stack)
                    self._stack = stack.pop_all()
                    self._entered = True
            except BaseException:
                self._lock.release()
                raise
        except BaseException:
            self._guard.remove()
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._entered = False
        try:
            try:
                self._stack.close()
            finally:
                self._lock.release()
        finally:
            self._guard.remove()


def graph_cutter(model: nn.Module) -> Callable[[], None]:
    """What cuts from the autograd graph the tensors a forward leaves in ``model``'s
    modules, as attributes or buffers (RecurrentGemma's recurrent states, the
    probabilities a module keeps): a forward in the call's graph would otherwise leave
    them tied to it, its memory held and the model no longer copyable. Each keeps the
    values the forward gave it, as a forward without gradients leaves them, so that they
    stay consistent with what else the forward changed (a cache's length, hooks a library
    installs once); tensors the model held before the call are left alone."""
    # by identity, the objects themselves kept so that no id is reused by a new tensor meanwhile
    held = [
        (module, {id(value): value for value in (*vars(module).values(), *module._buffers.values())})
        for module in model.modules()
    ]

    def cut() -> None:
        for module, before in held:
            for values in (vars(module), module._buffers):
                for name, value in list(values.items()):
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None and id(value) not in before:
                        values[name] = value.detach()

    return cut


_MODEL_CHANGES = frozenset({ModelChanges.__enter__.__code__, ModelChanges.__exit__.__code__})
