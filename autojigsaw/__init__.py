"""autojigsaw: automatic domain + tensor parallelism for unmodified PyTorch models."""

from .api import evaluate, plan
from .cost_model.devices import DeviceSpec
from .cost_model.calibrate import calibrate
from .loading import load_shard, stand_in
from .mesh import MeshSpec
from .plan import NodeSharding, Plan
from .runtime.init import meta_init
from .runtime.module import ParallelModule


def parallelize(model, mesh, example_inputs=None, *, compile: bool = True, training: bool = True,
                memory_budget: int | None = None, device: str | DeviceSpec | None = None,
                input_placements=None, output_placements=None, example_kwargs=None,
                plan: Plan | None = None, mp_policy=None, activation_checkpointing: str = "none",
                data_parallel: str | None = None) -> ParallelModule:
    """Shard `model` over `mesh` (a named DeviceMesh) by a plan; returns the module to train.

    With example_inputs=None the model is planned at its first call, like torch.compile.
    """
    return ParallelModule(model, mesh, example_inputs, example_kwargs, compile=compile,
                          training=training, memory_budget=memory_budget, device=device,
                          input_placements=input_placements, output_placements=output_placements,
                          plan=plan, mp_policy=mp_policy, activation_checkpointing=activation_checkpointing,
                          data_parallel=data_parallel)


__all__ = ["MeshSpec", "NodeSharding", "ParallelModule", "Plan", "calibrate", "evaluate", "load_shard", "meta_init", "parallelize", "plan",
           "stand_in"]
