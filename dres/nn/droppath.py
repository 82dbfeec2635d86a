"""ResidualDroppath (Park) and timm drop path as one controller of per-sample residual scales.

The controller owns the iteration count (its parity picks the kind of iteration) and the
per-(residual, sample-slot) masks. For residual ``i`` and a batch of ``B`` samples it hands out the
``(row_scale, grad_scale)`` pair that :func:`dres.ops.residual_layer_norm` takes (docs/ops.md's table):

=======================================  ==============  ===============
iteration                                row_scale       grad_scale
=======================================  ==============  ===============
residual_droppath, even iteration        m               m
residual_droppath, odd iteration         1               1 - m
drop_path (timm, scale by keep)          m / keep        m / keep
eval (``not self.training``) or p = 0    None            None
=======================================  ==============  ===============

``m`` is a per-sample Bernoulli(keep) mask. Even iterations draw fresh masks; the odd iteration that
follows reuses them, slot by slot, so the samples whose branch was dropped are the ones whose branch
alone is trained (``X + f(X).detach() * m + f(X) * (1 - m)``: the value of a plain residual).
``residual_droppath_literal`` detaches the rate-0 branches on odd iterations too. ``residual_droppath_frozen``
(the paper's abstract: the undropped parts frozen) has residual_droppath's pairs and, on odd iterations, a
second pass of each kept branch with its weights held whose gradient (``m``, :meth:`ResidualDroppath.held_scales`)
reaches the block's input: ``X + f_w(X) * (1 - m) + f_sg(w)(X) * m`` in gradient, the plain residual in value.
drop_path mode draws fresh masks every iteration (shared by the iteration's micro-batches), which
has the same distribution as timm's per-forward draw.

The masks are counter-based: the mask of (residual, slot) in draw ``d`` is a hash of
``(seed, rank, d, residual, slot)`` computed with integer tensor ops on the scales' device. So

* every data-parallel rank draws its own masks (timm draws per rank), deterministic from (seed, rank);
* the only state is the iteration counter, a device tensor: :meth:`next_iteration` is one in-place
  add and :meth:`scales` reads the parity on the device (``torch.where``), with no host sync, so a
  whole training step including both can be captured in a CUDA graph and replayed;
* resume is exact on any number of ranks (the state is the counter and the seed, not a generator),
  and CPU and CUDA draw the same masks bit for bit.

The iteration advances once per optimizer step, by itself: a controller that drew masks in a
training forward is advanced right after the next ``torch.optim`` step (a process-wide step
post-hook), so the micro-batches of a step share masks (gradient accumulation), ResidualDroppath's
even and odd iterations are consecutive optimizer steps, a recomputing forward (activation
checkpointing) sees the masks of its step, a step that ``GradScaler`` skips does not advance it, and
a captured step records the advance with the optimizer. A caller may keep the count itself
instead: the first :meth:`next_iteration` call makes the count the caller's (the trainers call it
once per step, after the step; a call right after the step that advanced it is that step's, not a
second advance), and a training forward that finds an optimizer step taken since the previous one
with no call between warns, once. An update that is not a ``torch.optim`` step needs the calls.

All training batches of a run have the size of the first one (the masks pair slots of an even and an
odd iteration); another size raises ``ValueError``: use ``drop_last=True`` and equal micro-batches.
The state (counter, seed) is this module's extra state, so it is part of the owning model's
``state_dict``; a ``state_dict`` without it (the checkpoint of the model before conversion) loads
strictly and leaves the state as it is.
"""

from __future__ import annotations

import hashlib
import itertools
import warnings
import weakref
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

# residual_droppath_literal: Park's Algorithm 1 as written, where an odd iteration detaches every kept branch,
# those of rate 0 (block 0 under the linear-in-depth rule) too; residual_droppath leaves rate-0 residuals alone.
# residual_droppath_frozen: the abstract's "freezing the undropped parts": an odd iteration holds the kept branches'
# weights but lets their gradient through to the block's input (:meth:`ResidualDroppath.held_scales`)
MODES = ("residual_droppath", "drop_path", "residual_droppath_literal", "residual_droppath_frozen")
HELD_MODE = "residual_droppath_frozen"

Scales = tuple[Optional[torch.Tensor], Optional[torch.Tensor]]
NO_SCALES: Scales = (None, None)

_M32 = 0xFFFFFFFF
_SLOT_BITS = 20  # a residual's slots are hashed as residual * 2**20 + slot: batches up to 2**20 per rank

# controllers that optimizer steps advance: those that drew masks in a training forward, not advanced by hand
_advancing: "weakref.WeakSet[ResidualDroppath]" = weakref.WeakSet()
_optimizer_steps = 0  # torch.optim steps taken in this process since the first training forward of a controller
_step_hook = None
# every controller by its key, for the op a compiled forward calls (:func:`_counter_of_noted_forward`)
_controllers: "weakref.WeakValueDictionary[int, ResidualDroppath]" = weakref.WeakValueDictionary()
_keys = itertools.count()
_noted_forward_op = None
_stream_key = None  # stream_key, taken by Dynamo as a constant (sha256 is not traceable)


def _after_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1
    for controller in list(_advancing):
        controller._advance_after_step()


def _watch_optimizer_steps() -> None:
    """Register the process-wide optimizer step post-hook (once)."""
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_post_hook(torch.compiler.disable(_after_optimizer_step))


def _counter_of_noted_forward(counter: torch.Tensor, key: int, batch_size: int) -> torch.Tensor:
    """The host side of a training forward that a compiled graph runs, on every call of the graph: controller
    ``key`` checks the batch size and notes the forward (:meth:`ResidualDroppath._note_training_forward`), so
    neither is traced (a first batch stored while tracing would recompile the model at its second call). Returns a
    copy of the counter, which the traced draw reads: the copy orders the draw after the note and keeps the op in
    the graph."""
    controller = _controllers.get(key)
    if controller is not None:
        controller._note_training_forward(batch_size)
    return counter.clone()


def _define_noted_forward_op() -> None:
    """``dres::droppath_noted_forward`` (:func:`_counter_of_noted_forward`) and the stream key Dynamo takes as a
    constant, made when the first controller is built: at import they would import Dynamo, Inductor and Triton
    (seconds) into every import of a converter."""
    global _noted_forward_op, _stream_key
    if _noted_forward_op is None:
        # cudagraph_unsafe: torch.compile's CUDA graphs (mode="reduce-overhead") leave it out of their replays,
        # which would skip its body; dres.compile_step's whole-step capture records the advance it leads to instead
        _noted_forward_op = torch.library.custom_op("dres::droppath_noted_forward", _counter_of_noted_forward,
                                                    mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
        _noted_forward_op.register_fake(lambda counter, key, batch_size: torch.empty_like(counter))
        from torch._dynamo import assume_constant_result

        _stream_key = assume_constant_result(stream_key)


def depth_linear_rates(drop_prob: float, num_residuals: int, residuals_per_block: int = 2) -> list[float]:
    """timm's rule, ``linspace(0, drop_prob, depth)`` over blocks; both residuals of a block share it."""
    num_blocks = max(1, -(-num_residuals // residuals_per_block))
    block_rates = [drop_prob * b / (num_blocks - 1) if num_blocks > 1 else drop_prob for b in range(num_blocks)]
    return [block_rates[i // residuals_per_block] for i in range(num_residuals)]


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32), split in 16-bit halves so int64 never overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons, hash-prospector): a bijection of [0, 2**32) with near-ideal avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stream_key(seed: int, rank: int) -> tuple[int, int]:
    """Two 32-bit words naming the mask stream of (seed, rank) (sha256: unrelated streams for distinct pairs)."""
    digest = hashlib.sha256(f"dres.ResidualDroppath:{seed}:{rank}".encode()).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:8], "little")


def mask_bits(key: tuple[int, int], draw: torch.Tensor, num_residuals: int, batch_size: int) -> torch.Tensor:
    """(num_residuals, batch_size) int64 uniform in [0, 2**24): draw number ``draw`` (a 0-dim int64
    tensor, on the device the bits are made on) of the stream ``key``."""
    if batch_size > 1 << _SLOT_BITS:
        raise ValueError(f"ResidualDroppath: batch size {batch_size} exceeds the {1 << _SLOT_BITS} sample slots")
    device = draw.device
    slots = torch.arange(batch_size, dtype=torch.int64, device=device)
    residuals = torch.arange(num_residuals, dtype=torch.int64, device=device).unsqueeze(1)
    counter = (residuals << _SLOT_BITS) | slots
    draw_word = _hash32((draw & _M32) ^ key[0])
    return _hash32(_hash32((counter + draw_word) & _M32) ^ key[1]) >> 8


def default_rank() -> int:
    """This process's rank in the default process group (0 outside torch.distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class ResidualDroppath(nn.Module):
    """Per-residual, per-sample scales for ResidualDroppath or timm drop path (see the module doc).

    drop_prob: the drop rate (of the deepest residual when ``depth_linear``).
    num_residuals: how many residuals the controlled network has (2 per transformer block).
    mode: ``"residual_droppath"`` (alternate even/odd iterations) or ``"drop_path"`` (timm).
    depth_linear: timm's linear-in-depth rate over blocks of ``residuals_per_block`` residuals;
        False gives every residual ``drop_prob``.
    seed: with ``rank``, names the mask stream (masks do not consume any torch RNG).
    rank: the data-parallel rank; None takes the process's rank in the default process group
        (:attr:`stream_rank`).
    """

    def __init__(self, drop_prob: float, num_residuals: int, mode: str = "residual_droppath",
                 depth_linear: bool = True, residuals_per_block: int = 2, seed: int = 0,
                 rank: Optional[int] = None):
        super().__init__()
        _define_noted_forward_op()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not 0.0 <= drop_prob < 1.0:
            raise ValueError(f"drop_prob must lie in [0, 1), got {drop_prob}")
        if num_residuals < 1:
            raise ValueError(f"num_residuals must be >= 1, got {num_residuals}")
        self.drop_prob = float(drop_prob)
        self.num_residuals = int(num_residuals)
        self.mode = mode
        self.rates = (depth_linear_rates(drop_prob, num_residuals, residuals_per_block) if depth_linear
                      else [float(drop_prob)] * num_residuals)
        self.seed = int(seed)
        self.rank = rank
        self.slots: Optional[int] = None  # the batch size of the run, fixed by the first training batch
        # the iteration counter lives on the model's device, so a captured step advances it on replay
        self.register_buffer("counter", torch.zeros((), dtype=torch.int64), persistent=False)
        # keep iff bits < threshold: P(keep) = threshold / 2**24 exactly (integers: untouched by .double())
        self.register_buffer("keep_threshold", torch.tensor([round((1.0 - r) * 2 ** 24) for r in self.rates],
                                                             dtype=torch.int64), persistent=False)
        self._scales: Optional[tuple[tuple[torch.device, int], list[Scales], list[Optional[torch.Tensor]]]] = None
        self.advanced_by_hand = False  # whether next_iteration was called: the count is then the caller's
        self._drew_since_advance = False  # a training forward drew masks since the last advance
        self._advanced_by_step = False  # an optimizer step advanced it and no training forward followed yet
        self._steps_at_forward = 0  # _optimizer_steps at the last training forward (hand-advanced controllers)
        self._called_since_forward = False  # next_iteration was called since the last training forward
        self._warned = False
        self._register()

    def _register(self) -> None:
        self._key = next(_keys)
        _controllers[self._key] = self

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        _define_noted_forward_op()  # unpickled in a process that built no controller yet
        self._register()  # a copy (deepcopy, pickle) notes its own forwards

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob}, num_residuals={self.num_residuals}, mode={self.mode}"

    @property
    def active(self) -> bool:
        """Whether scales are non-trivial: training mode and a positive drop rate."""
        return self.training and self.drop_prob > 0

    @property
    def iteration(self) -> int:
        """The iteration count (reads the device counter: a host sync; for logs and tests)."""
        return int(self.counter.item())

    @property
    def odd(self) -> bool:
        return self.iteration % 2 == 1

    def next_iteration(self) -> None:
        """Advance to the next optimizer step by hand (once per step, after it). The first call makes
        the count the caller's: optimizer steps no longer advance it, and a call right after the step
        that advanced it is that step's. One in-place add on the counter's device, so it can be
        captured in a CUDA graph with the step."""
        if self.advanced_by_hand or not self._advanced_by_step:
            self._advance()
        self.advanced_by_hand = True
        _advancing.discard(self)
        self._advanced_by_step = False
        self._called_since_forward = True

    def _advance(self) -> None:
        self.counter.add_(1)
        self._scales = None
        self._drew_since_advance = False

    def _advance_after_step(self) -> None:
        """An optimizer step was taken: advance if a training forward drew masks since the last advance."""
        if self._drew_since_advance and not self.advanced_by_hand:
            self._advance()
            self._advanced_by_step = True

    def _note_training_forward(self, batch_size: int) -> None:
        """Check the batch size; enlist the controller with the optimizer steps, or (advanced by hand) warn once
        when an optimizer step was taken since the last training forward and next_iteration was not called."""
        self._check_batch(batch_size)
        _watch_optimizer_steps()
        if not self.advanced_by_hand:
            _advancing.add(self)
            self._drew_since_advance, self._advanced_by_step = True, False
            return
        if _optimizer_steps != self._steps_at_forward and not self._called_since_forward and not self._warned:
            self._warned = True
            warnings.warn("ResidualDroppath: this training forward reuses the masks of the previous one although an "
                          "optimizer step was taken between them. next_iteration() was called before, which makes "
                          "the count the caller's: call it after every optimizer step, or never (optimizer steps "
                          "then advance it)", stacklevel=3)
        self._steps_at_forward, self._called_since_forward = _optimizer_steps, False

    def _draw_index(self, counter: torch.Tensor) -> torch.Tensor:
        # an odd residual_droppath iteration reuses the masks of the even one before it
        return counter if self.mode == "drop_path" else counter >> 1

    def masks_on(self, batch_size: int, device, counter: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The masks of iteration ``counter`` (default: the current one), (num_residuals, batch_size) float32 on
        ``device``, 1 = keep."""
        counter = self.counter if counter is None else counter
        bits = mask_bits(_stream_key(self.seed, self.stream_rank), self._draw_index(counter).to(device),
                         self.num_residuals, batch_size)
        return (bits < self.keep_threshold.to(device).unsqueeze(1)).to(torch.float32)

    @property
    def stream_rank(self) -> int:
        """The rank whose mask stream this controller draws: ``rank``, or the process's own. Read, not stored, at
        each draw: a first compiled forward that stored it would change what the graph was traced with, and
        recompile the whole model at the second."""
        return default_rank() if self.rank is None else self.rank

    @property
    def masks(self) -> Optional[torch.Tensor]:
        """The masks of the current iteration for the run's batch size (None before the first batch)."""
        return None if self.slots is None else self.masks_on(self.slots, self.counter.device)

    def _check_batch(self, batch_size: int) -> None:
        if self.slots is None:
            self.slots = batch_size
        elif batch_size != self.slots:
            raise ValueError(
                f"ResidualDroppath: batch size {batch_size} differs from the {self.slots} sample slots of this "
                "run's masks (an odd iteration reuses the masks of the even one slot by slot). Use equal-sized "
                "batches and micro-batches (drop_last=True)."
            )

    def _compute_scales(self, batch_size: int, device: torch.device, counter: torch.Tensor):
        """The (row_scale, grad_scale) pairs and the held scales of every residual at iteration ``counter``."""
        m = self.masks_on(batch_size, device, counter)
        held = [None] * self.num_residuals
        if self.mode == "drop_path":
            keep = self.keep_threshold.to(device, torch.float32) * 2.0 ** -24  # exact: thresholds are < 2**25
            pairs = [(s, s) for s in (m / keep.unsqueeze(1)).unbind(0)]
        else:
            odd = (counter.to(device) & 1).bool()  # the parity stays on the device: no host sync
            row = torch.where(odd, torch.ones_like(m), m)
            grad = torch.where(odd, 1.0 - m, m)
            pairs = list(zip(row.unbind(0), grad.unbind(0)))
            if self.mode == HELD_MODE:
                held = list(torch.where(odd, m, torch.zeros_like(m)).unbind(0))
        literal = self.mode == "residual_droppath_literal"
        pairs = [NO_SCALES if rate == 0.0 and not literal else pair for rate, pair in zip(self.rates, pairs)]
        return pairs, [None if rate == 0.0 else h for rate, h in zip(self.rates, held)]

    def _drawn_scales(self, batch_size: int, device: torch.device):
        """Eager: noted here and cached until the next advance. Compiled: traced from the counter the op noting
        the forward returns, so the graph draws on every call and the note runs on every call."""
        if torch.compiler.is_compiling():
            counter = _noted_forward_op(self.counter, self._key, batch_size)
            return (device, batch_size), *self._compute_scales(batch_size, device, counter)
        self._note_training_forward(batch_size)
        if self._scales is None or self._scales[0] != (device, batch_size):
            self._scales = ((device, batch_size), *self._compute_scales(batch_size, device, self.counter))
        return self._scales

    def scales(self, batch_size: int, device) -> list[Scales]:
        """``(row_scale, grad_scale)`` for every residual, for a batch of ``batch_size`` on ``device``.

        Computed on ``device`` from the counter without a host sync; the micro-batches of one
        iteration share them (recomputed after :meth:`next_iteration`, inside a captured step too)."""
        if not self.active:
            return [NO_SCALES] * self.num_residuals
        return self._drawn_scales(int(batch_size), torch.device(device))[1]

    def held_scales(self, batch_size: int, device) -> list[Optional[torch.Tensor]]:
        """residual_droppath_frozen: for every residual, the per-sample share of the gradient that passes through
        the branch to the block's input with the branch's weights held (m, the kept samples, on odd iterations; 0
        on even ones), None where no branch is held (other modes, rate 0, not training). Call it after
        :meth:`scales` in the same forward; the residual op's own pair is residual_droppath's, so on odd
        iterations the dropped samples train the branch and every sample's gradient reaches the input."""
        if not self.active or self.mode != HELD_MODE:
            return [None] * self.num_residuals
        return self._drawn_scales(int(batch_size), torch.device(device))[2]

    # state_dict: the counter and the seed travel with the model's checkpoint (each rank adds its own rank)
    def get_extra_state(self) -> dict:
        return {"iteration": self.iteration, "seed": self.seed, "mode": self.mode, "rates": list(self.rates)}

    def set_extra_state(self, state: dict) -> None:
        if state["mode"] != self.mode or len(state["rates"]) != self.num_residuals:
            raise ValueError(f"ResidualDroppath state is for mode={state['mode']!r} with {len(state['rates'])} "
                             f"residuals; this controller has mode={self.mode!r} with {self.num_residuals}")
        self.counter.fill_(int(state["iteration"]))  # in place: a captured step keeps reading this buffer
        self.seed = int(state["seed"])
        self._scales = None
        self._drew_since_advance = self._advanced_by_step = False

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        # the checkpoint of the model before conversion has no controller: it loads strictly all the same
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        key = prefix + "_extra_state"
        if key not in state_dict and key in missing_keys:
            missing_keys.remove(key)


def build_droppath(droppath: Optional[ResidualDroppath], drop_path: float, droppath_mode: str,
                   num_residuals: int, seed: int = 0) -> Optional[ResidualDroppath]:
    """The controller a model uses: the one given, else one built from ``drop_path`` (None if 0)."""
    if HELD_MODE in (droppath_mode, getattr(droppath, "mode", None)):
        raise ValueError(f"droppath mode {HELD_MODE} runs each branch a second time with its weights held, which "
                         "only the ResNet converter does (dres.convert_timm_resnet)")
    if droppath is not None:
        if droppath.num_residuals != num_residuals:
            raise ValueError(f"droppath controls {droppath.num_residuals} residuals but the stack has {num_residuals}")
        return droppath
    if drop_path > 0:
        return ResidualDroppath(drop_path, num_residuals, mode=droppath_mode, seed=seed)
    return None


def refuse_two_drop_paths(drop_path: float, blocks: Sequence[nn.Module], has_own: Callable[[nn.Module], bool]) -> None:
    """A converter's ``drop_path`` and the model's own DropPath would drop every branch twice."""
    if drop_path > 0 and any(has_own(blk) for blk in blocks):
        raise ValueError("the model already drops paths with timm's DropPath; create it with drop_path_rate=0 "
                         "and pass drop_path= here")


def droppath_scales(droppath: Optional[ResidualDroppath], x: torch.Tensor) -> Optional[list[Scales]]:
    """The scales of ``droppath`` for the batch ``x`` (batch first), None without a controller."""
    return None if droppath is None else droppath.scales(x.shape[0], x.device)
