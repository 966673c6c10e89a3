"""One trainer rank's gradients of one training step (a helper process of
tests/test_data_parallel.py; rank 0 writes what every rank computed between them).

    python tests/rank_gradients.py GROUPS OUT SETTINGS_JSON

RANK, WORLD_SIZE and ASYNCRL_RENDEZVOUS (a file) describe the group. SETTINGS_JSON:
{"cases": [[override, ...], ...], "average": bool}: each case is one freshly built algorithm
on the same process group; with `average` the ranks' gradients are averaged as FSDP2 does by
default, not summed (the negative control).
"""

from __future__ import annotations

import json
import sys

import torch

from asyncrl.algos.parallel import SINGLE
from asyncrl.config.keys import build_config
from asyncrl.distributed import ranks as ranks_module
from asyncrl.train.components import build_trainer_side


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor (a collective for a DTensor: every rank calls it at the same point)."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return (full_tensor() if full_tensor else tensor).detach().clone()


def average_instead_of_summing() -> None:
    """FSDP2's default reduction from now on: the mean over ranks, not the sum."""
    shard = ranks_module.TorchRanks.shard

    def averaged(self, module):
        shard(self, module)
        for unit in module.modules():
            if hasattr(unit, "set_gradient_divide_factor"):
                unit.set_gradient_divide_factor(float(self.world_size))

    ranks_module.TorchRanks.shard = averaged


def step_gradients(groups, overrides, ranks=SINGLE):
    """The gradients each optimizer step of the step applies (per parameter name, full
    tensors), and the step's metrics."""
    config = build_config({}, overrides)
    _, _, build_algorithm = build_trainer_side(config, ranks)
    algo = build_algorithm()
    models = {id(algo.optimizer): algo.model}
    if hasattr(algo, "critic_optimizer"):
        models[id(algo.critic_optimizer)] = algo.critic
    seen = []

    def record(optimizer, args, kwargs):
        model = models[id(optimizer)]
        seen.append({n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None})

    for optimizer_id in models:
        optimizer = algo.optimizer if id(algo.optimizer) == optimizer_id else algo.critic_optimizer
        optimizer.register_step_pre_hook(record)
    metrics = algo.step(groups, 3)
    return seen, metrics


def main() -> None:
    groups_path, out, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    groups = torch.load(groups_path, weights_only=False)  # the test's own file
    if settings.get("average"):
        average_instead_of_summing()
    ranks = ranks_module.init_ranks(torch.device("cpu"))
    # only rank 0 has the step's groups, as in a run: the others train what it sends them
    mine = groups if ranks.rank == 0 else []
    results = [step_gradients(mine, case, ranks) for case in settings["cases"]]
    if ranks.rank == 0:
        torch.save(results, out)


if __name__ == "__main__":
    main()
