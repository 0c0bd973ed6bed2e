"""Loss parallelism: the loss of a language model computed over vocabulary shards.

Without it, the output head of a parallelized model gathers its column-parallel logits
(``column_gather``), so every rank holds batch x sequence x vocabulary values, and the loss is
torch's cross-entropy over them. With it, when the model is called with labels the head keeps
its vocabulary shard and the loss goes through ``nn.functional.vocab_parallel_cross_entropy``:
no rank holds the whole logits. Called without labels (evaluation, ``generate()``), the model
gathers and returns whole logits as before.

It is switched on only where the loss is provably torch's cross-entropy of the head's output:

- the plan has the head (``model.get_output_embeddings()``) as a plain ``column_gather`` layer,
  gathered because its output is a model output (so the head's shard reaches the returned
  logits through ops that keep it a shard), and its out-features are the config's vocab_size;
- the model computes its loss either through Hugging Face's ``self.loss_function`` resolving to
  ``ForCausalLMLoss`` or ``ForMaskedLMLoss`` (this model instance then gets its own
  loss_function that does what those do, over the shard), or inline as BERT's and RoBERTa's
  masked-LM heads do (``CrossEntropyLoss()(logits.view(-1, vocab_size), labels.view(-1))``,
  labels used for nothing else: their source is checked line by line). There the labels are
  kept from the model's forward and the loss is computed from the returned logits.

Anything else keeps today's behaviour, and ``model.autoshard_state.loss_parallel`` (also
logged) says why. A loss computed from a tensor other than the returned logits is an error.
"""

import ast
import inspect
import logging
import textwrap
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..core import ops
from ..conventions import huggingface as hf
from ..nn.functional import vocab_parallel_cross_entropy
from ..nn.linear import ColumnParallelLinear
from .shard_guard import guard_value
from ..core.styles import Style
from ..core.parallel_state import state_of

logger = logging.getLogger("autoshard")


@dataclass
class LossParallel:
    """What parallelize decided about loss parallelism for one model."""

    enabled: bool
    reason: str
    head: str = ""  # the output head's module name
    mode: str = ""  # "loss_function" (the model's own loss_function) or "labels" (kept from the forward)
    vocab_size: int = 0

    def __str__(self) -> str:
        if self.enabled:
            return (f"loss parallelism on: with labels, {self.head!r} keeps its vocabulary shard and the loss is "
                    f"computed over the shards ({self.reason})")
        return f"loss parallelism off: {self.reason}; the output head gathers whole logits"


def _forward_lines(model: nn.Module):
    """The statements of the model class's forward (docstring and comments left out), one line
    each as ast.unparse writes them; None if its source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(model).forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    function = tree.body[0]
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]
    text = "\n".join(ast.unparse(statement) for statement in body)
    return [line.strip() for line in text.splitlines() if line.strip()]


def _loss_mode(model: nn.Module):
    """("loss_function", hf function) / ("labels", None), or (None, why not)."""
    losses = hf.vocabulary_losses()
    if losses is None:
        return None, "transformers is not installed"
    if not hf.is_pretrained_model(model):
        return None, f"{type(model).__name__} is not a Hugging Face model whose loss autoshard knows"
    lines = _forward_lines(model)
    if lines is None:
        return None, f"the source of {type(model).__name__}.forward cannot be read"
    if any(hf.LOSS_FUNCTION_CALL in line for line in lines):
        if hf.has_own_loss_function(model):
            return None, f"{type(model).__name__} has a loss_function of its own"
        function = model.loss_function
        if any(function is loss for loss in losses):
            return "loss_function", function
        return None, f"{type(model).__name__}'s loss_function is {getattr(function, '__name__', function)}"
    uses = {line for line in lines if "labels" in line}
    required = all(any(line.startswith(want) for line in lines for want in ((w,) if isinstance(w, str) else w))
                   for w in hf.MASKED_LM_LOSS_LINES)
    if uses and uses <= hf.MASKED_LM_LABEL_LINES and required:
        return "labels", None
    return None, f"{type(model).__name__}.forward computes its loss in a way autoshard does not recognise"


def _head(model: nn.Module, plan):
    """(name, module) of the output head, or (None, why not)."""
    head = hf.output_embeddings(model)
    if head is None:
        return None, "the model has no output head (get_output_embeddings() is None)"
    name = next((name for name, module in model.named_modules() if module is head), None)
    if name is None:
        return None, "the output head is not a submodule of the model"
    layer = next((layer for layer in plan.layers if layer.module == name), None)
    if layer is None:
        return None, f"the plan does not name the output head {name!r}"
    if not layer.construct.splits_logits_for_loss or layer.style is not Style.COLUMN_GATHER or \
            layer.reason != "model_output":
        return None, (f"the plan makes the output head {name!r} {layer.style!r} (reason {layer.reason!r}), not a "
                      "column layer gathered because its output is a model output")
    if not isinstance(head, ColumnParallelLinear) or not head.gather_output or not head._plain_split:
        return None, f"the output head {name!r} is not a plainly split, gathering ColumnParallelLinear"
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab_size != head.out_features:
        return None, f"the output head {name!r} has {head.out_features} out-features, the config's vocab_size is {vocab_size}"
    return name, head


def decide(model: nn.Module, plan, group) -> LossParallel:
    if group.size() == 1:
        return LossParallel(False, "a group of one rank holds the whole logits anyway")
    name, head = _head(model, plan)
    if name is None:
        return LossParallel(False, head)
    mode, detail = _loss_mode(model)
    if mode is None:
        return LossParallel(False, detail, head=name)
    how = (f"{type(model).__name__}'s loss_function ({detail.__name__})" if mode == "loss_function"
           else f"{type(model).__name__}'s inline cross-entropy")
    return LossParallel(True, how, head=name, mode=mode, vocab_size=head.out_features)


class _Hooks:
    """The model's forward hooks: with labels, the head keeps its shard for that call, and the
    loss is computed over the shards, either by the model's own loss_function (replaced on this
    instance) or here, from the returned logits, with the labels kept from the forward."""

    def __init__(self, model: nn.Module, head: ColumnParallelLinear, decision: LossParallel, hf_loss):
        self.head = head
        self.decision = decision
        self.hf_loss = hf_loss
        self.group = head.group
        parameters = list(inspect.signature(type(model).forward).parameters)[1:]
        self.labels_position = parameters.index("labels") if "labels" in parameters else None
        self.active = False
        self.labels = None
        self.loss_logits = None

    def _labels_of(self, args, kwargs):
        if "labels" in kwargs:
            return kwargs["labels"], "kwargs"
        if self.labels_position is not None and len(args) > self.labels_position:
            return args[self.labels_position], "args"
        return None, None

    def before(self, module, args, kwargs):
        labels, where = self._labels_of(args, kwargs)
        # Set on every call, so that a forward that raised leaves nothing behind for the next one.
        self.active = labels is not None
        self.head.gather_output = not self.active
        self.labels, self.loss_logits = None, None
        if not self.active or self.decision.mode != "labels":
            return None
        self.labels = labels
        if where == "kwargs":
            kwargs = {**kwargs, "labels": None}
        else:
            args = args[:self.labels_position] + (None,) + args[self.labels_position + 1:]
        return args, kwargs

    def after(self, module, args, kwargs, output):
        if not self.active:
            return None
        self.active = False
        self.head.gather_output = True
        if self.decision.mode == "labels":
            labels, self.labels = self.labels, None
            return self._with_loss(output, labels)
        seen, self.loss_logits = self.loss_logits, None
        logits = output.logits if hasattr(output, "logits") else output[1]
        if seen is not None and seen is not logits:
            raise RuntimeError(
                f"parallelize(loss_parallel=True): {type(module).__name__} computed its loss from a tensor other "
                "than the logits it returns, so autoshard cannot vouch for it; parallelize it with "
                "loss_parallel=False")
        if isinstance(logits, torch.Tensor) and hasattr(output, "logits"):
            output["logits"] = self._guarded(logits)
        return None

    def _guarded(self, logits: torch.Tensor) -> torch.Tensor:
        """The returned logits, this rank's vocabulary shard, guarded: an argmax or a softmax of them
        outside autoshard is refused, naming autoshard.gather_logits."""
        spec = self.head.shard_specs["weight"]
        return guard_value(logits, f"the logits returned beside the loss (the head {self.decision.head!r})",
                           f"the vocabulary, {self.decision.vocab_size} entries, split over {spec.world_size} "
                           f"ranks, this is rank {spec.rank}'s")

    def _with_loss(self, output, labels):
        logits = output.logits if hasattr(output, "logits") else output[0]
        self._check_shard(logits)
        loss = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.to(logits.device).view(-1),
                                            self.group)
        if isinstance(output, tuple):
            return (loss, self._guarded(output[0])) + output[1:]
        return type(output)(loss=loss, **{key: self._guarded(value) if key == "logits" else value
                                          for key, value in output.items() if key != "loss"})

    def _check_shard(self, logits: torch.Tensor) -> None:
        local = self.head.local_out_features
        if logits.shape[-1] != local:
            raise RuntimeError(
                f"parallelize(loss_parallel=True): the logits reaching the loss have {logits.shape[-1]} vocabulary "
                f"entries, where the head {self.decision.head!r} gives this rank {local}; parallelize the model "
                "with loss_parallel=False")

    def loss_function(self, logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                      shift_labels=None, **kwargs):
        """The Hugging Face loss (ForCausalLMLoss or ForMaskedLMLoss) of the shard, step by step."""
        if not self.active:
            # Called outside a forward with labels: whole logits, Hugging Face's own function.
            return self.hf_loss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                                ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        if vocab_size != self.decision.vocab_size:
            raise RuntimeError(f"parallelize(loss_parallel=True): the loss was asked for vocab_size={vocab_size}, "
                               f"the head has {self.decision.vocab_size}; use loss_parallel=False")
        self._check_shard(logits)
        self.loss_logits = logits
        logits = logits.float()  # Hugging Face computes the loss in float32
        if hf.is_causal_lm_loss(self.hf_loss):
            if shift_labels is None:
                labels = F.pad(labels, (0, 1), value=ignore_index)
                shift_labels = labels[..., 1:].contiguous()
            labels = shift_labels
        logits = logits.view(-1, logits.shape[-1])
        labels = labels.view(-1).to(logits.device)
        reduction = "sum" if num_items_in_batch is not None else "mean"
        loss = vocab_parallel_cross_entropy(logits, labels, self.group, ignore_index=ignore_index,
                                            reduction=reduction)
        if reduction == "sum":
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        return loss


def install(model: nn.Module, plan, group, enabled: bool) -> LossParallel:
    """Decides, installs the hooks where loss parallelism is on, logs the decision, returns it."""
    decision = decide(model, plan, group) if enabled else LossParallel(False, "parallelize(loss_parallel=False)")
    if decision.enabled:
        head = model.get_submodule(decision.head)
        hf_loss = model.loss_function if decision.mode == "loss_function" else None
        hooks = _Hooks(model, head, decision, hf_loss)
        if decision.mode == "loss_function":
            model.loss_function = hooks.loss_function
        model.register_forward_pre_hook(hooks.before, with_kwargs=True)
        model.register_forward_hook(hooks.after, with_kwargs=True)
    if group.rank() == 0:
        logger.info("autoshard: %s", decision)
    return decision


def gather_logits(model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """Whole logits from the logits ``model(..., labels=...)`` returned beside its loss, which are
    this rank's vocabulary shard when loss parallelism is on (one all-gather, differentiable).
    Whole logits (the model called without labels, or loss parallelism off) are returned as they are."""
    state = state_of(model)
    decision: Optional[LossParallel] = getattr(state, "loss_parallel", None) if state is not None else None
    if decision is None or not decision.enabled or logits.shape[-1] == decision.vocab_size:
        return logits
    return ops.gather_from_parallel(logits, -1, decision.vocab_size, state.group.group_name)
