"""What GRPO and PPO share: the step's samples as one batch, its log-probs, one guarded
optimizer update, the KL penalty and entropy bonus, and the frozen reference policy."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from asyncrl.config import AlgoConfig
from asyncrl.core.losses import kl_estimate, masked_mean, masked_sum, normalise
from asyncrl.core.types import Group
from asyncrl.faults import fault_point
from asyncrl.models.logprobs import completion_logprobs
from asyncrl.models.lora import is_lora

if TYPE_CHECKING:
    from asyncrl.models.policy import Policy


class NonFiniteLoss(RuntimeError):
    """The loss or gradient is NaN/inf; the step was not applied."""


def pad_right(tensors: list[torch.Tensor], width: int, value: float | bool) -> torch.Tensor:
    """Pads [G, T_i] tensors on the right to [G, width] and concatenates them along dim 0."""
    padded = [torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in tensors]
    return torch.cat(padded, dim=0)


def token_versions(group: Group) -> torch.Tensor:
    """[R, T]: the weights version that sampled each token (-1 where masked)."""
    if group.token_versions is not None:
        return group.token_versions
    versions = torch.full(group.completion_ids.shape, group.version_max, dtype=torch.long)
    return versions.masked_fill(~group.policy_mask.bool(), -1)


def stack_groups(groups: list[Group], pad_id: int) -> dict[str, Any]:
    """The step's samples as one batch of B rows (B = N*G, or more where samples have
    segments: `Group.row_samples`): prompts (list of B rows), completion ids, mask, behaviour
    log-probs and token versions [B, T], rewards [N, G] (one per sample), and `row_samples`
    [B] int64, each row's sample as an index into the flattened rewards (`n*G + sample`;
    `arange(B)` where no group has segments), so a per-sample value `x` [N, G] is per row as
    `per_row(x, batch)`. `completion_mask` marks the trained tokens; where episodes (or
    segments) have tokens that are attended to but not trained, `token_mask` marks every real
    token. Every group must have the same G (a ValueError names the first that has not)."""
    num_samples = groups[0].num_samples
    for group in groups:
        if group.num_samples != num_samples:
            raise ValueError(
                f"ordinal {group.ordinal} has {group.num_samples} samples, ordinal "
                f"{groups[0].ordinal} {num_samples}: a step's groups must have the same G"
            )
    width = max(g.completion_ids.shape[1] for g in groups)
    batch = {
        "token_versions": pad_right([token_versions(g) for g in groups], width, -1),
        "prompts": [g.prompt_ids for g in groups for _ in range(g.num_rows)],
        "completion_ids": pad_right([g.completion_ids for g in groups], width, pad_id),
        "completion_mask": pad_right([g.policy_mask for g in groups], width, False),
        "behaviour_logprobs": pad_right([g.behaviour_logprobs for g in groups], width, 0.0),
        "rewards": torch.stack([g.rewards for g in groups]),
        "row_samples": row_samples(groups, num_samples),
    }
    if any(g.loss_mask is not None for g in groups):
        batch["token_mask"] = pad_right([g.completion_mask for g in groups], width, False)
    return batch


def row_samples(groups: list[Group], num_samples: int) -> torch.Tensor:
    """[B] int64: each row's index into the step's flattened [N*G] samples."""
    if all(g.row_samples is None for g in groups):
        return torch.arange(len(groups) * num_samples)
    return torch.cat([n * num_samples + g.row_sample_index() for n, g in enumerate(groups)])


def per_row(values: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    """[B]: a per-sample value of the step (`values` [N, G], an advantage or a reward) at each
    of its B rows, through `batch["row_samples"]` (rows of one sample get the same value)."""
    flat: torch.Tensor = values.reshape(-1)[batch["row_samples"]]
    return flat


def row_groups(batch: dict[str, Any]) -> torch.Tensor:
    """[B] int64: the group (0..N-1) of each row of a stacked batch."""
    groups: torch.Tensor = batch["row_samples"] // batch["rewards"].shape[1]
    return groups


def token_mask(batch: dict[str, Any]) -> torch.Tensor:
    """[B, T] bool: every real token of a stacked batch (what the model attends to)."""
    mask: torch.Tensor = batch.get("token_mask", batch["completion_mask"])
    return mask


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A stacked batch with its tensors on `device` (the prompts stay a list of rows)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


ROW_KEYS = ("completion_ids", "completion_mask", "behaviour_logprobs", "token_mask", "row_samples")
"""The per-row tensors of a stacked batch that `select` carries (`token_versions` stays whole:
only the step's metrics read it)."""


def select(batch: dict[str, Any], rows: torch.Tensor | slice) -> dict[str, Any]:
    """The rows `rows` (indices or a slice) of a stacked batch: its per-row tensors (with
    `row_samples`, each row's index into the step's samples) and prompts. Rewards ([N, G],
    per sample) are not per row and are left out."""
    if isinstance(rows, slice):
        prompts = batch["prompts"][rows]
    else:
        prompts = [batch["prompts"][i] for i in rows.tolist()]
    out: dict[str, Any] = {"prompts": prompts}
    for key in ROW_KEYS:
        if key in batch:
            out[key] = batch[key][rows]
    return out


def micro_batches(num_rows: int, micro_batch_size: int) -> list[slice]:
    """Consecutive row slices of at most `micro_batch_size` rows (0: one slice of all)."""
    size = micro_batch_size or num_rows
    return [slice(i, min(i + size, num_rows)) for i in range(0, num_rows, size)]


def shortest_first(rows: torch.Tensor, mask: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """`rows` (a step's rows to train, ascending, so each group's rows are together) with each
    group's rows ordered by the width their tokens reach in `mask` [B, T] (stably, the
    shortest first); `groups` [B] is each row's group (`row_groups`: nondecreasing, and a
    group may have any number of rows, as where samples have segments). The micro-batches cut
    from a group then hold rows of like widths: a pass runs its rows up to its longest one
    (`used_width`), and in a 60-step SmolLM2 run in passes of 4 rows this pads 1.17x the real
    completion tokens instead of 1.26x. The groups stay in their order and together, so a
    pass still runs each prompt once."""
    if len(rows) == 0:
        return rows
    columns = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    widths = (mask[rows].bool() * columns).amax(dim=1)
    # one stable sort by (group, width): widths are < T + 1
    order = (groups[rows] * (mask.shape[1] + 1) + widths).argsort(stable=True)
    return rows[order]


class StepStats:
    """Metrics of one optimizer step gathered over its micro-batches: token-weighted means,
    except `*_max` (max) and `*_min` (min). With one micro-batch, exactly its own values."""

    def __init__(self) -> None:
        self._parts: list[tuple[dict[str, float], float]] = []

    def add(self, stats: dict[str, float], num_tokens: float) -> None:
        self._parts.append((stats, num_tokens))

    def gathered(self, parts_of_ranks: list[list[tuple[dict[str, float], float]]]) -> StepStats:
        """The stats of every rank's micro-batches (`Ranks.gather(stats.parts)`), in rank
        order: one rank's gathered stats are its own."""
        out = StepStats()
        out._parts = [part for parts in parts_of_ranks for part in parts]
        return out

    @property
    def parts(self) -> list[tuple[dict[str, float], float]]:
        return self._parts

    def result(self) -> dict[str, float]:
        if len(self._parts) == 1:
            return dict(self._parts[0][0])
        out: dict[str, float] = {}
        for key in {k: None for stats, _ in self._parts for k in stats}:
            values = [(stats[key], n) for stats, n in self._parts if key in stats]
            if key.endswith("_max"):
                out[key] = max(v for v, _ in values)
            elif key.endswith("_min"):
                out[key] = min(v for v, _ in values)
            else:
                weight = sum(n for _, n in values)
                out[key] = sum(v * n for v, n in values) / weight if weight > 0 else 0.0
        return out


def batch_logprobs(
    model: PreTrainedModel,
    batch: dict[str, Any],
    temperature: float,
    pad_id: int,
    entropy_grad: bool = False,
    shared_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies [B, T] of a stacked batch's completion tokens under `model`
    (the entropy differentiable only with `entropy_grad`; each distinct prompt run once with
    `shared_prompts`, `train.shared_prompts`)."""
    logprobs, entropy = completion_logprobs(
        model,
        batch["prompts"],
        batch["completion_ids"],
        token_mask(batch),
        temperature,
        pad_id,
        with_entropy=True,
        entropy_grad=entropy_grad,
        shared_prompts=shared_prompts,
    )
    assert entropy is not None
    return logprobs, entropy


def regularise(
    loss: torch.Tensor,
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    mask: torch.Tensor,
    config: AlgoConfig,
    normaliser: torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
    entropy_coef: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Adds the KL penalty to the reference (when `ref_logprobs` is given) and subtracts the
    entropy bonus (`entropy_coef`, default `config.entropy_coef`), each a sum over
    `token_weights` (`loss_weights`; default the mask) divided by `normaliser` (default the
    mask's real tokens), as the policy loss is; terms with a zero coefficient are not added at
    all (the loss stays bit-identical to the bare surrogate). The stats are this micro-batch's
    token means."""
    weights = mask if token_weights is None else token_weights
    entropy_coef = config.entropy_coef if entropy_coef is None else entropy_coef
    stats = {"entropy": float(masked_mean(entropy.detach(), mask))}
    if ref_logprobs is not None:
        kl = kl_estimate(logprobs, ref_logprobs, config.kl_estimator)
        stats["kl_ref"] = float(masked_mean(kl.detach(), mask))
        loss = loss + config.kl_coef * normalise(masked_sum(kl, weights), mask, normaliser)
    if config.entropy_coef > 0:
        bonus = normalise(masked_sum(entropy, weights), mask, normaliser)
        loss = loss - entropy_coef * bonus
    return loss, stats


def adamw(
    parameters: Iterable[torch.nn.Parameter], lr: float, config: AlgoConfig
) -> torch.optim.AdamW:
    """AdamW over `parameters` at `lr` with the run's `algo.weight_decay`, `algo.adam_beta1`,
    `algo.adam_beta2` and `algo.adam_epsilon` (the policy's and the critic's optimizer).

    The fused implementation (one kernel for all tensors) where the parameters are on a CPU or
    CUDA device: on the demo's CPU model a step takes 1.0 ms against 4.4 ms for torch's
    default per-tensor loop there (docs/time_to_reward.md)."""
    params = list(parameters)
    fused = all(p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(
        params,
        lr=lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_epsilon,
        weight_decay=config.weight_decay,
        fused=fused or None,
    )


class StepAbandoned(Exception):
    """A preemption notice came while the training step had changed no weight yet: the step is
    given up (its gradients dropped), so the run's checkpoint can be cut at once, at the state
    before it (`abandonable`)."""


_scope = threading.local()


@contextlib.contextmanager
def abandonable(stop: Callable[[], bool]) -> Iterator[None]:
    """The training step inside may be given up while `stop()` says so and no optimizer step
    has been taken: each micro-batch's `backward` raises `StepAbandoned` first (an algorithm
    needs nothing of its own for it; `apply_gradients` ends the chance). With several trainer
    ranks `stop` must be a collective every rank calls (`TorchRanks.agree`): every rank runs
    the same passes, so all of them ask it before the same backward and give up together."""
    _scope.stop, _scope.committed = stop, False
    try:
        yield
    finally:
        _scope.stop = None


def _give_up_if_stopped() -> None:
    stop = getattr(_scope, "stop", None)
    if stop is not None and not _scope.committed and stop():
        raise StepAbandoned("a preemption notice came before the step changed a weight")


def backward(loss: torch.Tensor, what: str = "loss", check: bool = True) -> float:
    """Accumulates `loss`'s gradient (one micro-batch's share of the step's loss); raises
    `NonFiniteLoss` before that if it is not finite, and `StepAbandoned` inside `abandonable`
    when a stop was asked. Returns its value. `check=False` (ranks > 1: every rank must run the
    backward's collectives) leaves the refusal to `apply_gradients`, whose gradient norm is
    global: a non-finite loss on any rank makes it non-finite on all."""
    fault_point("train.backward")
    _give_up_if_stopped()
    value = loss.item()
    if check and not math.isfinite(value):
        raise NonFiniteLoss(f"{what} is {value}; the step was not applied")
    loss.backward()
    return value


def apply_gradients(
    optimizer: torch.optim.Optimizer,
    parameters: Iterable[torch.nn.Parameter],
    max_grad_norm: float,
    what: str = "loss",
) -> float:
    """Clips the accumulated gradient to `max_grad_norm` (0: no clipping), steps, and frees the
    gradients (they take as much memory as the weights; nothing reads them between steps).
    Returns the gradient norm; raises `NonFiniteLoss` before changing any weight if it is not
    finite."""
    _scope.committed = True  # from here on the step changes weights: it is finished
    params = list(parameters)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or float("inf"))
    if not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLoss(
            f"gradient norm of the {what} is {float(grad_norm)}; the step was not applied"
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


def gradient_step(
    loss: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    parameters: Iterable[torch.nn.Parameter],
    max_grad_norm: float,
    what: str = "loss",
) -> float:
    """backward, clip to `max_grad_norm` (0: no clipping), step; returns the gradient norm.
    Raises `NonFiniteLoss` before changing any weight if the loss or the gradient is not
    finite. (One micro-batch: `backward` then `apply_gradients`.)"""
    optimizer.zero_grad(set_to_none=True)
    backward(loss, what)
    return apply_gradients(optimizer, parameters, max_grad_norm, what)


def weights_sha256(model: torch.nn.Module) -> str:
    """SHA-256 (first 16 hex digits) of a model's weights, tensor by tensor in name order."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


class ReferencePolicy:
    """The frozen policy the KL penalty pulls towards: a copy of the policy's *initial* weights,
    or, with LoRA adapters, the policy itself with its adapters switched off (the frozen base:
    no copy).

    It is not checkpointed: every launch rebuilds the policy from its config (the preset and
    `run.seed`, or `model.path`) before loading a checkpoint, so this copy is the same each
    time. `sha256` lets a resume prove it (a `model.path` whose files changed would not be).

    `matmul_dtype` (bf16 training under autocast, one rank): the copy's linear layers are
    stored in it, cast once here instead of by autocast at every pass (autocast caches no cast
    of a weight that needs no gradient, so each pass cast them again) and at half the memory.
    The log-probs are the same bit for bit: autocast multiplies in that dtype either way. The
    output layer, when it is the input embedding's weight, stays as it is: the embedding's
    lookup reads it in fp32."""

    def __init__(
        self,
        initial_policy: Policy,
        shared_prompts: bool = False,
        matmul_dtype: torch.dtype | None = None,
    ) -> None:
        self.shared_prompts = shared_prompts
        self.adapters_off = is_lora(initial_policy.model)
        if self.adapters_off:
            self.model = initial_policy.model
            self.sha256 = str(initial_policy.base_sha256)
        else:
            self.model = copy.deepcopy(initial_policy.model)
            self.model.eval()
            self.model.requires_grad_(False)
            self.sha256 = weights_sha256(self.model)  # of the weights as loaded
            if matmul_dtype is not None:
                cast_linear_layers(self.model, matmul_dtype)

    @torch.no_grad()
    def logprobs(self, batch: dict[str, Any], temperature: float, pad_id: int) -> torch.Tensor:
        off = self.model.disable_adapter() if self.adapters_off else contextlib.nullcontext()  # type: ignore[operator]
        training = self.model.training
        self.model.eval()  # the shared model trains; its reference forward has no dropout
        with off, _restore_mode(self.model, training):
            logprobs, _ = completion_logprobs(
                self.model,
                batch["prompts"],
                batch["completion_ids"],
                token_mask(batch),
                temperature,
                pad_id,
                shared_prompts=self.shared_prompts,
            )  # no entropy: the reference only needs the chosen tokens' log-probs
        return logprobs


def reference_dtype(train_dtype: str, world_size: int) -> torch.dtype | None:
    """The dtype `ReferencePolicy` stores its linear layers in: bf16 where the passes run under
    bf16 autocast on one rank (FSDP2 wants one dtype across a sharded model); None (as loaded)
    elsewhere."""
    return torch.bfloat16 if train_dtype == "bfloat16" and world_size == 1 else None


def cast_linear_layers(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Stores every `nn.Linear` of `model` in `dtype`, but for one whose weight is also an
    embedding's (tied output layers)."""
    for module in _untied_linear_layers(model):
        module.to(dtype)


def _untied_linear_layers(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """`model`'s `nn.Linear` layers but those whose weight is also an embedding's."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return [
        module
        for module in model.modules()
        if isinstance(module, torch.nn.Linear) and id(module.weight) not in embedded
    ]


class FrozenCasts:
    """The frozen linear weights of LoRA models (the base under the adapters) cast to
    `dtype`, bf16 autocast's, once a step, and swapped in for that step's passes only (`with
    casts:`; freed at its end).

    Autocast caches no cast of a weight that needs no gradient, so without them every forward
    pass cast the whole base again, and with `train.shared_prompts` a pass's prompt and
    completion graphs each held a cast copy until its backward. The log-probs and gradients
    are the same bit for bit: autocast multiplies in `dtype` either way (tests/test_lora.py).
    Outside the steps the models hold only their fp32 parameters, which the engine and the
    evaluator share and the publishes, checkpoints and exports read: no copy is held while an
    evaluation runs. A tied output layer keeps its weight (the embedding's lookup reads it in
    fp32). Nothing is cast where `dtype` is None (fp32 passes; FSDP2 ranks, which want one
    dtype across a sharded model) or a model has no adapters."""

    def __init__(self, models: Iterable[torch.nn.Module], dtype: torch.dtype | None) -> None:
        self.dtype = dtype
        self.frozen: list[tuple[torch.nn.Linear, torch.Tensor]] = []
        if dtype is None:
            return
        for model in models:
            if not is_lora(model):
                continue
            for module in _untied_linear_layers(model):
                weight = module.weight
                if not weight.requires_grad and weight.dtype != dtype:
                    self.frozen.append((module, weight))

    def __enter__(self) -> None:
        cast: dict[int, torch.nn.Parameter] = {}  # a weight two models share: one cast
        for module, weight in self.frozen:
            if id(weight) not in cast:
                low = weight.detach().to(self.dtype)
                cast[id(weight)] = torch.nn.Parameter(low, requires_grad=False)
            module.weight = cast[id(weight)]

    def __exit__(self, *exc: object) -> None:
        for module, weight in self.frozen:
            module.weight = weight


@contextlib.contextmanager
def _restore_mode(model: torch.nn.Module, training: bool) -> Iterator[None]:
    try:
        yield
    finally:
        model.train(training)
