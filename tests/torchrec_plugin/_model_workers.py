"""What the spawned ranks of `test_models.py` run: TorchRec's own recommendation models, sharded
by `DistributedModelParallel` on `tpu` with the plan `torchrec_plugin.planner` makes for a TPU
topology, trained on TorchRec's `RandomRecDataset`."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.random import RandomRecDataset
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingEnv
from torchrec.models.deepfm import SimpleDeepFMNN
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

import torchrec_plugin

KEYS = ("cat_0", "cat_1", "cat_2", "cat_3")
ROWS = (1000, 64, 4000, 300)
DIM = 8
DENSE = 13
BATCH = 32
STEPS = 24
CYCLED_BATCHES = 2
"""The dataset repeats this many batches (its labels are random): the loss falls as the model
fits them."""


def _ebc() -> EmbeddingBagCollection:
    tables = [EmbeddingBagConfig(name=f"t_{key}", num_embeddings=rows, embedding_dim=DIM, feature_names=[key])
              for key, rows in zip(KEYS, ROWS)]
    return EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "DLRM": lambda: DLRM(embedding_bag_collection=_ebc(), dense_in_features=DENSE, dense_arch_layer_sizes=[16, DIM],
                         over_arch_layer_sizes=[16, 1]),
    "DLRM_DCN": lambda: DLRM_DCN(embedding_bag_collection=_ebc(), dense_in_features=DENSE,
                                 dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1], dcn_num_layers=2,
                                 dcn_low_rank_dim=4),
    "SimpleDeepFMNN": lambda: SimpleDeepFMNN(num_dense_features=DENSE, embedding_bag_collection=_ebc(),
                                             hidden_layer_size=16, deep_fm_dimension=4),
}


def train_models(rank: int, world: int, chip: str, out: str) -> None:
    """Each model of `MODELS`, planned for `world` devices of `chip` and sharded under DMP on
    `tpu`, trains `STEPS` steps (fused Adagrad for the tables, Adagrad for the dense layers,
    BCE loss); rank 0 writes every model's losses (averaged over ranks) and plan to `out`."""
    os.environ.update(LOCAL_WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("cpu:gloo,tpu:tpu_dist")
    device = torch.device("tpu", 0)
    results = {}
    for name, make in MODELS.items():
        torch.manual_seed(0)
        model = make()
        apply_optimizer_in_backward(torch.optim.Adagrad, model.sparse_arch.parameters(), {"lr": 0.1})
        sharders = torchrec_plugin.sharders()
        planner = torchrec_plugin.planner(torchrec_plugin.topology(chip, world_size=world), batch_size=BATCH)
        plan = planner.collective_plan(model, sharders, dist.group.WORLD)
        dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders,
                                       env=ShardingEnv.from_process_group(dist.group.WORLD))
        dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(dmp.named_parameters())),
                                      lambda params: torch.optim.Adagrad(params, lr=0.1))
        optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
        data = iter(RandomRecDataset(keys=list(KEYS), batch_size=BATCH, hash_sizes=list(ROWS),
                                     ids_per_features=[3, 1, 2, 1], num_dense=DENSE, manual_seed=rank,
                                     num_generated_batches=CYCLED_BATCHES, num_batches=STEPS))
        losses = []
        for batch in data:
            batch = batch.to(device)
            logits = dmp(batch.dense_features, batch.sparse_features).squeeze(-1)
            loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels.float())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            mean = loss.detach().cpu()
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
        sharding = {table: parameter.sharding_type
                    for module in plan.plan.values() for table, parameter in module.items()}
        results[name] = {"losses": losses, "sharding": sharding}
    if rank == 0:
        import json

        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
