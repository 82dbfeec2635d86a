"""One optimizer step of a user's own training loop, compiled and captured as one CUDA graph.

``compile_step(model, optimizer, loss_fn)`` gives a loop what dres's trainer has: the model's forward
compiled with ``torch.compile`` and, on CUDA, the whole step (forward, backward, gradient clipping, the
optimizer's step) captured once in a CUDA graph and replayed, so that the host issues one launch a step::

    model = dres.convert_timm_vit(timm.create_model("vit_small_patch16_224"), drop_path=0.1).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = dres.compile_step(model, optimizer, lambda m, x, y: F.cross_entropy(m(x), y))
    for images, labels in loader:  # equal-sized batches, on the GPU
        loss = step(images, labels)  # forward, backward and the AdamW step: one graph replay
    print(loss.item(), step.captured)

``loss_fn(model, *batch, **kwargs)`` returns the loss (a 0-dim tensor; put ``torch.autocast`` inside it);
it receives the compiled model. A step returns the loss detached, valid until the next call (on CUDA it
is the graph's static output). The first ``warmup_steps`` steps run eagerly on a side stream (lazy
initialisation, compilation, autotuning and the optimizer's state happen there, as torch's "whole
network capture" recipe asks); the next one is captured and every later one replays the graph, its
batch copied into static inputs (tensors nested in tuples, lists and dicts; the other arguments must
not change). For the capture the optimizer's groups are made capturable and each group's ``lr``
becomes a 0-dim device tensor that an LR scheduler fills in place and every replay reads (an lr
assigned by hand is taken over at the next step); its other hyperparameters are fixed at the capture.

What cannot be captured runs eagerly and says why in one line, once, through ``log``
(:attr:`CapturedStep.why_eager`): a device that is not CUDA, an optimizer that reads its learning rate
on the host (SGD without ``fused=True``) or has no capturable mode, a model under DDP or FSDP, and a
step whose capture fails (the step it was capturing then runs eagerly). A batch of another shape or
dtype than the captured one (a short last batch) runs eagerly and says so once. ``capture=True``
refuses instead; ``capture=False`` never captures. ResidualDroppath controllers (``model.droppath``)
advance at every optimizer step, replays included (:mod:`dres.nn.droppath`).

The mechanics, shared with the trainer's captured step (``dres.train.step.GraphedStep``):
:class:`StaticInputs` (fixed-address inputs) and :class:`GraphedFunction` (side-stream warm-up, the
capture, the replay).
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

from dres.ops.checks import replayed_launches


class CaptureError(RuntimeError):
    """Capturing a function in a CUDA graph failed; the message is the first line of torch's error."""


def first_line(error: BaseException) -> str:
    """The first line of an error's message, or its type's name when it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _first_cause(error: RuntimeError) -> RuntimeError:
    """The error a failed capture began with: ending the capture raises again, in the handling of the first."""
    while isinstance(error.__context__, RuntimeError):
        error = error.__context__
    return error


def check_warmup_steps(warmup_steps: int) -> None:
    if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 1:
        raise ValueError(f"warmup_steps must be >= 1 (lazy initialisation cannot be captured), got {warmup_steps}")


@contextlib.contextmanager
def quiet_uncaptured_steps():
    """Silences torch's warning that a capturable optimizer steps outside a graph: these steps are deliberate."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True")
        yield


@contextlib.contextmanager
def ordered_side_stream(stream: torch.cuda.Stream):
    """Queue the block's GPU work on ``stream``, after the work already queued on the current stream and before
    the work queued on it after the block."""
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        current.wait_stream(stream)


class StaticInputs:
    """Tensors at fixed addresses for a captured function to read, one per name, shaped like the first
    batch's: each batch is copied into them before the function runs (on the device, a device copy)."""

    def __init__(self, batch: dict[str, torch.Tensor]):
        self.tensors = {k: torch.empty_like(v) for k, v in batch.items()}

    def misfit(self, batch: dict[str, torch.Tensor]) -> Optional[str]:
        """The first name in ``batch`` that the static inputs cannot take (none of that name, another
        shape or dtype), or None."""
        for k, v in batch.items():
            dst = self.tensors.get(k)
            if dst is None or dst.shape != v.shape or dst.dtype != v.dtype:
                return k
        return None

    def describe(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {k: (tuple(t.shape), str(t.dtype)) for k, t in self.tensors.items()}

    def load(self, batch: dict[str, torch.Tensor]) -> None:
        for k, v in batch.items():
            self.tensors[k].copy_(v)


class GraphedFunction:
    """``fn()`` (no arguments: it reads static inputs) run eagerly by :meth:`warm_up` on a side
    ``stream`` (lazy initialisation, compilation and autotuning happen there), captured once by
    :meth:`capture` on that stream and replayed by :meth:`replay`, which returns the outputs of the
    captured call (static: the graph rewrites them at every replay). Both run ``fn`` inside
    :func:`dres.ops.checks.replayed_launches`: what it compiles keeps the dres kernels, whose launches the
    replays do not pay."""

    def __init__(self, fn: Callable[[], Any], device: torch.device, *, warmup_steps: int = 3, stream=None):
        check_warmup_steps(warmup_steps)
        self.fn, self.device, self.warmup_steps = fn, device, warmup_steps
        self.stream = stream if stream is not None else torch.cuda.Stream(device)  # warm-up and capture
        self.warmed = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.outputs = None

    @property
    def warming(self) -> bool:
        """Whether the next call is an eager warm-up call (fewer than ``warmup_steps`` ran, nothing captured)."""
        return self.graph is None and self.warmed < self.warmup_steps

    def warm_up(self):
        """One eager call on the side stream, ordered after the work already queued on the current one."""
        with ordered_side_stream(self.stream), quiet_uncaptured_steps(), replayed_launches():
            out = self.fn()  # quiet: a capturable optimizer's eager steps
        self.warmed += 1
        return out

    def capture(self) -> None:
        """Capture one call; :class:`CaptureError` with torch's reason where it fails (the call's kernels
        were then recorded, not run)."""
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"), replayed_launches():
                outputs = self.fn()
        except RuntimeError as e:  # something in the call synchronised or allocated on the host
            self._end_generator_capture()
            raise CaptureError(first_line(_first_cause(e))) from e
        self.graph, self.outputs = graph, outputs

    def _end_generator_capture(self) -> None:
        """A failed capture leaves the CUDA generator in its capture mode (torch 2.11: every later eager draw
        then raises); an empty capture's end takes it out again."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=self.stream):
                pass

    def replay(self):
        self.graph.replay()
        return self.outputs

    def release(self) -> None:
        """Free the captured graph. NCCL keeps a communicator alive while a graph that captured its
        collectives exists, so destroying the process group first hangs (pytorch/pytorch#115388): a
        trainer releases the graph before it tears the group down."""
        if self.graph is not None:
            torch.cuda.synchronize(self.device)
            self.graph.reset()
            self.graph = None


# ------------------------------------------------------------------------------------ the optimizer
def optimizer_blocker(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why this optimizer's step cannot be captured in a CUDA graph, or None."""
    if isinstance(optimizer, torch.optim.SGD):
        if all(group.get("fused") for group in optimizer.param_groups):
            return None
        return ("SGD reads a device learning rate only in its fused kernel (foreach SGD calls .item() on it): "
                "pass fused=True")
    if "capturable" not in optimizer.defaults:
        return f"{type(optimizer).__name__} has no capturable mode (its step reads its state on the host)"
    return None


def make_capturable(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Ready ``optimizer`` in place for a captured step and return each group's lr tensor: capturable
    groups (where it has the option), the state made before on its parameter's device (the capturable
    steps keep their step count there), and each group's lr a 0-dim float32 tensor on its parameters'
    device, which LR schedulers fill in place (``fill_``) and the replays read."""
    lrs = []
    for group in optimizer.param_groups:
        if "capturable" in optimizer.defaults:
            group["capturable"] = True
        device = group["params"][0].device
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.device != p.device:
                    state[k] = v.to(p.device)
        lr = group["lr"]
        if not (isinstance(lr, torch.Tensor) and lr.device == device and lr.dtype == torch.float32 and lr.dim() == 0):
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)
        lrs.append(group["lr"])
    return lrs


def _distributed(model: nn.Module) -> bool:
    """Whether ``model`` is wrapped by DDP or FSDP, or has FSDP2-sharded modules."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return (isinstance(model, (nn.parallel.DistributedDataParallel, FullyShardedDataParallel))
            or any(isinstance(m, FSDPModule) for m in model.modules()))


def capture_blocker(model: nn.Module, optimizer: torch.optim.Optimizer) -> Optional[str]:
    """Why a step of ``model`` and ``optimizer`` cannot be captured, as far as it is known before the
    capture, or None."""
    devices = sorted({str(p.device) for group in optimizer.param_groups for p in group["params"]})
    if len(devices) > 1:
        return f"the parameters are on several devices ({', '.join(devices)})"
    device = torch.device(devices[0])
    if device.type != "cuda":
        return f"the device is {device.type}, not CUDA"
    if _distributed(model):
        return "DDP and FSDP communicate through hooks that compile_step does not capture"
    return optimizer_blocker(optimizer)


# ------------------------------------------------------------------------------------ the batch
@dataclasses.dataclass(frozen=True, repr=False)
class _TensorSlot:
    name: str

    def __repr__(self) -> str:
        return "a tensor"


def _split(value, name: str, tensors: dict[str, torch.Tensor]):
    """``value`` with every tensor (in tuples, lists and dicts) replaced by a slot of its name, which is
    added to ``tensors``."""
    if isinstance(value, torch.Tensor):
        tensors[name] = value
        return _TensorSlot(name)
    if type(value) is dict:
        return {k: _split(v, f"{name}[{k!r}]", tensors) for k, v in value.items()}
    if type(value) in (list, tuple) or (isinstance(value, tuple) and hasattr(value, "_fields")):
        items = [_split(v, f"{name}[{i}]", tensors) for i, v in enumerate(value)]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def split_arguments(args: tuple, kwargs: dict) -> tuple[dict[str, torch.Tensor], tuple[tuple, dict]]:
    """The tensors of a call by name (``args[0]``, ``labels``, ``args[1]['mask']``) and the call's
    skeleton: ``(args, kwargs)`` with the tensors replaced by slots."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = (tuple(_split(v, f"args[{i}]", tensors) for i, v in enumerate(args)),
                {k: _split(v, k, tensors) for k, v in kwargs.items()})
    return tensors, skeleton


def fill_arguments(skeleton, tensors: dict[str, torch.Tensor]):
    """The skeleton with each slot replaced by its tensor in ``tensors``."""
    if isinstance(skeleton, _TensorSlot):
        return tensors[skeleton.name]
    if type(skeleton) is dict:
        return {k: fill_arguments(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, tuple) and hasattr(skeleton, "_fields"):
        return type(skeleton)(*(fill_arguments(v, tensors) for v in skeleton))
    if type(skeleton) in (list, tuple):
        return type(skeleton)(fill_arguments(v, tensors) for v in skeleton)
    return skeleton


def first_difference(old: tuple[tuple, dict], new: tuple[tuple, dict]) -> Optional[tuple[str, Any, Any]]:
    """(name, old value, new value) of the first argument where two calls' skeletons
    (:func:`split_arguments`) differ, or None."""
    (old_args, old_kwargs), (new_args, new_kwargs) = old, new
    if len(old_args) != len(new_args):
        return "the number of positional arguments", len(old_args), len(new_args)
    if old_kwargs.keys() != new_kwargs.keys():
        return "the keywords", sorted(old_kwargs), sorted(new_kwargs)
    pairs = [(f"args[{i}]", a, b) for i, (a, b) in enumerate(zip(old_args, new_args))]
    pairs += [(k, old_kwargs[k], new_kwargs[k]) for k in old_kwargs]
    return next((d for name, a, b in pairs if (d := _difference(a, b, name)) is not None), None)


def _difference(old, new, name: str) -> Optional[tuple[str, Any, Any]]:
    if type(old) is not type(new):
        return name, old, new
    if type(old) is dict:
        if old.keys() != new.keys():
            return name, old, new
        children = [(old[k], new[k], f"{name}[{k!r}]") for k in old]
    elif isinstance(old, (list, tuple)):
        if len(old) != len(new):
            return name, old, new
        children = [(a, b, f"{name}[{i}]") for i, (a, b) in enumerate(zip(old, new))]
    else:
        try:
            same = old is new or bool(old == new)
        except Exception:  # an argument whose == is no truth value (a numpy array) is not known to be the same
            same = False
        return None if same else (name, old, new)
    return next((d for a, b, n in children if (d := _difference(a, b, n)) is not None), None)


def _shape_of(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype}"


# ------------------------------------------------------------------------------------ the step
class CapturedStep:
    """``step(*batch, **kwargs) -> loss``: one optimizer step of ``loss_fn(model, *batch, **kwargs)``
    (see the module doc and :func:`compile_step`, which builds it).

    :attr:`captured` is True once the step runs as a replayed CUDA graph; :attr:`why_eager` is None, or
    the one line saying why the step runs eagerly (also given to ``log``, once, where it is not asked
    for with ``capture=False``)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable, *, compile: bool = True,
                 capture="auto", warmup_steps: int = 3, clip_grad_norm: Optional[float] = None,
                 log: Callable[[str], Any] = warnings.warn):
        _check_arguments(model, optimizer, loss_fn, compile, capture, warmup_steps, clip_grad_norm, log)
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.clip_grad_norm, self.log, self.capture = clip_grad_norm, log, capture
        # loss_fn gets the compiled module; shapes are static, and the graph is ours (no "reduce-overhead")
        self.forward_model = torch.compile(model, dynamic=False) if compile else model
        self.captured = False
        self.why_eager: Optional[str] = None
        self._graphed: Optional[GraphedFunction] = None  # None: every step runs eagerly
        self._lrs: list[torch.Tensor] = []  # the groups' device lr tensors, once the optimizer is made capturable
        self._inputs: Optional[StaticInputs] = None
        self._skeleton = None  # the first call's arguments, tensors replaced by slots
        self._static_call: Optional[tuple[tuple, dict]] = None  # the arguments the captured step reads
        self._captured_state = None  # the optimizer's state at the capture (a loaded state dict replaces it)
        self._warned_misfit = False
        if capture is False:
            self.why_eager = "dres.compile_step: the step runs eagerly (capture=False)"
            return
        reason = capture_blocker(model, optimizer)
        if reason is not None and capture is True:
            raise ValueError(f"compile_step: capture=True, but the step cannot be captured: {reason} "
                             "(capture='auto' runs it eagerly)")
        if reason is not None:
            self._run_eagerly(reason)
            return
        device = optimizer.param_groups[0]["params"][0].device
        self._graphed = GraphedFunction(self._static_step, device, warmup_steps=warmup_steps)

    # ------------------------------------------------------------------ one step
    def _step(self, *args, **kwargs) -> torch.Tensor:
        loss = self.loss_fn(self.forward_model, *args, **kwargs)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(f"loss_fn must return the loss as a 0-dim tensor, got {what}")
        loss.backward()
        if self.clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def _static_step(self) -> torch.Tensor:
        args, kwargs = self._static_call
        return self._step(*args, **kwargs)

    def _eager_step(self, args: tuple, kwargs: dict) -> torch.Tensor:
        """An eager step; one of a capturable optimizer (made so for the capture) is deliberate."""
        with quiet_uncaptured_steps() if self._lrs else contextlib.nullcontext():
            return self._step(*args, **kwargs)

    def _run_eagerly(self, reason: str) -> None:
        self.why_eager = f"dres.compile_step: the step runs eagerly: {reason}"
        self.log(self.why_eager)
        self._graphed = self._inputs = self._static_call = None

    # ------------------------------------------------------------------ per call
    def __call__(self, *args, **kwargs) -> torch.Tensor:
        if self._graphed is None:
            return self._eager_step(args, kwargs)
        tensors, skeleton = split_arguments(args, kwargs)
        if self._inputs is None:
            self._inputs, self._skeleton = StaticInputs(tensors), skeleton
            self._static_call = fill_arguments(skeleton, self._inputs.tensors)
        elif (diff := first_difference(self._skeleton, skeleton)) is not None:
            name, old, new = diff
            raise ValueError(f"compile_step: {name} is {new!r}, but the captured step was called with {old!r}: "
                             "arguments other than tensors must be the same at every call")
        if (name := self._inputs.misfit(tensors)) is not None:
            self._note_misfit(name, tensors[name])
            return self._eager_step(args, kwargs)
        self._inputs.load(tensors)
        graphed = self._graphed
        if graphed.warming:
            self._lrs = make_capturable(self.optimizer)  # again at each warm-up step: a state dict may have been loaded
            return graphed.warm_up()
        if graphed.graph is None:
            return self._capture(args, kwargs)
        self._follow_optimizer()
        return graphed.replay()

    def _capture(self, args: tuple, kwargs: dict) -> torch.Tensor:
        self._lrs = make_capturable(self.optimizer)
        try:
            self._graphed.capture()
        except CaptureError as e:
            if self.capture is True:
                message = f"compile_step: capturing the step failed ({e}); capture='auto' runs it eagerly"
                raise RuntimeError(message) from e
            self._run_eagerly(f"capturing the step failed ({e})")
            return self._eager_step(args, kwargs)  # the capture ran nothing: this batch's step is still to take
        self.captured = True
        self._captured_state = self.optimizer.state
        return self._graphed.replay()

    def _follow_optimizer(self) -> None:
        """Carry an lr set on the host into the device tensor the graph reads; refuse a replaced state."""
        groups = self.optimizer.param_groups
        if self.optimizer.state is not self._captured_state or len(groups) != len(self._lrs):
            raise RuntimeError("compile_step: the optimizer's state or parameter groups were replaced after the step "
                               "was captured (load_state_dict, add_param_group); do that before the first step")
        for group, lr in zip(groups, self._lrs):
            if group["lr"] is not lr:  # assigned by hand: a float, or another tensor
                lr.fill_(group["lr"])
                group["lr"] = lr

    def _note_misfit(self, name: str, tensor: torch.Tensor) -> None:
        if not self._warned_misfit:
            self._warned_misfit = True
            self.log(f"dres.compile_step: {name} is {_shape_of(tensor)}, not {_shape_of(self._inputs.tensors[name])} "
                     "as in the captured step: such steps run eagerly")


def _check_arguments(model, optimizer, loss_fn, compile, capture, warmup_steps, clip_grad_norm, log) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(model, *batch, **kwargs), got {type(loss_fn).__name__}")
    if not isinstance(compile, bool):
        raise TypeError(f"compile must be True or False, got {compile!r}")
    if not (isinstance(capture, bool) or isinstance(capture, str) and capture == "auto"):
        raise ValueError(f"capture must be 'auto', True or False, got {capture!r}")
    check_warmup_steps(warmup_steps)
    if clip_grad_norm is not None and (not isinstance(clip_grad_norm, numbers.Real) or isinstance(clip_grad_norm, bool)
                                       or not clip_grad_norm > 0):
        raise ValueError(f"clip_grad_norm must be None or a positive number, got {clip_grad_norm!r}")
    if not callable(log):
        raise TypeError(f"log must be callable with one line, got {type(log).__name__}")
    own = {id(p) for p in model.parameters()}
    if not all(id(p) in own for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("optimizer holds parameters that are not model's (was it built for another copy of the "
                         "model?)")


def compile_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable, *, compile: bool = True,
                 capture="auto", warmup_steps: int = 3, clip_grad_norm: Optional[float] = None,
                 log: Callable[[str], Any] = warnings.warn) -> CapturedStep:
    """The training step of ``model`` and ``optimizer`` under ``loss_fn`` as one call (the module doc).

    ``step(*batch, **kwargs)`` runs ``loss = loss_fn(model, *batch, **kwargs)``, ``loss.backward()``,
    ``clip_grad_norm_`` of the model's parameters where ``clip_grad_norm`` is given,
    ``optimizer.step()`` and ``optimizer.zero_grad(set_to_none=True)``, and returns the loss detached.
    ``compile``: ``torch.compile`` the model's forward (the module ``loss_fn`` gets is the compiled
    one). ``capture``: ``"auto"`` captures the step in a CUDA graph after ``warmup_steps`` eager steps
    where it can and runs it eagerly elsewhere, saying why in one line through ``log``; ``True``
    captures or raises that reason; ``False`` never captures. bf16 and fp32 only: a ``GradScaler``'s
    fp16 step is not what this step runs."""
    return CapturedStep(model, optimizer, loss_fn, compile=compile, capture=capture, warmup_steps=warmup_steps,
                        clip_grad_norm=clip_grad_norm, log=log)
