"""The critic of PPO: a separate value model, the policy's architecture with a scalar head.

It is a Hugging Face `*ForTokenClassification` model with `num_labels=1` (one value per
position), its body initialised from the policy's initial weights and its head from zero, as
NeMo RL, verl and OpenRLHF initialise a critic from the actor. Why a separate model rather than
a value head on the policy: the weights the engine generates with stay exactly the policy's;
the value loss cannot pull the policy's features (no `vf_coef` to balance); and the critic has
its own optimizer and learning rate. The cost is a second model's memory and compute.
"""

from __future__ import annotations

import copy

import torch
import transformers
from transformers import AutoConfig, AutoModelForTokenClassification, PreTrainedModel

from asyncrl.config import ConfigError, ModelConfig
from asyncrl.models.device import model_device
from asyncrl.models.logprobs import used_width
from asyncrl.models.lora import base_module, plain_state_dict
from asyncrl.models.policy import Policy, join_completions


def build_critic(policy: Policy, config: ModelConfig, seed: int) -> PreTrainedModel:
    """The value model for `policy` (built before training: it copies the initial weights).
    For `model.path` the body is loaded from that directory; for a preset it is copied from
    the policy. The scalar head starts at zero, so every initial value is 0."""
    if config.path:
        verbosity = transformers.utils.logging.get_verbosity()
        transformers.utils.logging.set_verbosity_error()  # "newly initialized: score.*"
        try:
            critic_config = AutoConfig.from_pretrained(
                config.path, num_labels=1, local_files_only=True
            )
            critic_config.classifier_dropout = 0.0  # values must not be random
            critic = AutoModelForTokenClassification.from_pretrained(
                config.path, config=critic_config, local_files_only=True
            )
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"model.path: cannot build a critic (…ForTokenClassification) from "
                f"{config.path}: {err}"
            ) from None
        finally:
            transformers.utils.logging.set_verbosity(verbosity)
    else:
        critic_config = copy.deepcopy(policy.model.config)
        critic_config.num_labels = 1
        critic_config.classifier_dropout = 0.0  # values must not be random
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            critic = AutoModelForTokenClassification.from_config(critic_config)
        # the body's initial weights (a LoRA policy's base: its adapters are not the critic's)
        body: torch.nn.Module = base_module(policy.model).base_model  # type: ignore[assignment]
        critic.base_model.load_state_dict(plain_state_dict(body))
    with torch.no_grad():
        critic.score.weight.zero_()
        if critic.score.bias is not None:
            critic.score.bias.zero_()
    return critic


def completion_values(
    critic: PreTrainedModel,
    prompts: list[list[int]],
    completion_ids: torch.Tensor,  # [B, T]
    completion_mask: torch.Tensor,  # [B, T] bool
    pad_id: int,
) -> torch.Tensor:
    """V(s_t) [B, T]: the critic's value of the state before completion token t (the prompt and
    the tokens before t), read at the same positions the policy predicts token t from. Masked
    positions are 0, and the columns after the last unmasked one are not run (`used_width`)."""
    device = model_device(critic)
    completion_ids, completion_mask = completion_ids.to(device), completion_mask.to(device)
    full, used = completion_ids.shape[1], used_width(completion_mask)
    completion_ids, completion_mask = completion_ids[:, :used], completion_mask[:, :used]
    inputs, width = join_completions(prompts, completion_ids, completion_mask, pad_id)
    values = critic(**inputs, use_cache=False).logits[:, width - 1 : -1, 0].float()
    values = values * completion_mask.to(values.dtype)
    return torch.nn.functional.pad(values, (0, full - used))
