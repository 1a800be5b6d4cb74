"""autojigsaw: automatic domain + tensor parallelism for unmodified PyTorch models."""

from .api import best_mesh, evaluate, parallelize, plan
from .cost_model.calibrate import calibrate
from .cost_model.devices import DeviceSpec
from .mesh import MeshSpec
from .options import Options
from .plan import NodeSharding, Plan
from .runtime.init import meta_init
from .runtime.loading import load_shard, stand_in
from .runtime.module import ParallelModule

__all__ = ["DeviceSpec", "MeshSpec", "NodeSharding", "Options", "ParallelModule", "Plan", "best_mesh", "calibrate",
           "evaluate", "load_shard", "meta_init", "parallelize", "plan", "stand_in"]
