"""torchrun --nproc-per-node 2 titan_moe_ep.py [--balanced] [--seq N]: torchtitan 0.3.0's own MoE layer
(``torchtitan.models.common.moe.MoE``: top-k router, ``AllToAllTokenDispatcher``, grouped-GEMM
experts) trained with expert parallelism over the ranks, AdamW, three steps.

Expert parallelism as torchtitan lays it out (``moe_sharding.expert_param_placement_sparse``:
the expert weights sharded on dim 0 over the ``ep`` mesh axis), applied by hand: each rank keeps
its ``experts / world`` slice of the stacked weights as plain parameters (torchtitan's
``GroupedExperts.forward`` takes ``to_local()`` of them anyway) and the dispatcher is wired to
the ``ep`` mesh (``RoutedExperts.parallelize``'s ``wire_meshes``). On the CPU (no accelerator)
it runs on gloo; under ``vramplan run`` on the emulated GPU and the fake process group.
``--balanced`` switches on torchtitan's own round-robin routing
(``--debug.moe_force_load_balance``): the same expert choices on every rank, known without data.
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.common.config_utils import (
    make_moe_config,
    make_router_config,
    make_token_dispatcher_config,
)
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts

DIM, HIDDEN, EXPERTS, TOP_K, BATCH = 64, 128, 8, 2, 2
SEQ = int(sys.argv[sys.argv.index("--seq") + 1]) if "--seq" in sys.argv else 32

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", rank) if cuda else torch.device("cpu")
set_spmd_backend("partial_dtensor")  # (the functional all-to-all path; spmd_types wants its own mesh)
mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("ep",))

router = make_router_config(dim=DIM, num_experts=EXPERTS, gate_param_init={}, top_k=TOP_K, score_func="softmax")
router._debug_force_load_balance = "--balanced" in sys.argv
config = make_moe_config(
    num_experts=EXPERTS, router=router, load_balance_coeff=None,
    routed_experts=RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=DIM, hidden_dim=HIDDEN, num_experts=EXPERTS),
        token_dispatcher=make_token_dispatcher_config(num_experts=EXPERTS, top_k=TOP_K, comm_backend="standard"),
    ),
)
with torch.device(device):
    moe = config.build()
    local = EXPERTS // world
    experts = moe.routed_experts.inner_experts
    for name in ("w1_EFD", "w2_EDF", "w3_EFD"):  # this rank's experts (Shard(0) over `ep`)
        setattr(experts, name, torch.nn.Parameter(torch.empty(local, *getattr(experts, name).shape[1:])))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    moe.tokens_per_expert_E.zero_()
moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)

opt = torch.optim.AdamW(moe.parameters(), lr=1e-3, foreach=True)  # (the CUDA default, on the CPU too)
torch.manual_seed(rank)
for _ in range(3):
    x = torch.randn(BATCH, SEQ, DIM, device=device)
    moe(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
