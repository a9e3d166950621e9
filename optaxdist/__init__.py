"""optaxdist: distributed, communication-efficient training as composable Optax transformations."""

from optaxdist import compress, topology
from optaxdist.accounting import CommLedger, CommStats, KindTotals, comm_stats
from optaxdist.checkpoint import (
    CheckpointMismatchError,
    rank_directory,
    restore_checkpoint,
    restore_stacked,
    save_checkpoint,
)
from optaxdist.comm import (
    AxisComm,
    Communicator,
    CrossComm,
    Hierarchy,
    MpiComm,
    NodeComm,
    SoloComm,
    axis_hierarchy,
    mesh_hierarchy,
    mpi_hierarchy,
    node_hierarchy,
)
from optaxdist.elastic import resize_replicas
from optaxdist.flax import nnx_replica, nnx_replicate, nnx_step
from optaxdist.optimizers import SignSgdState, SingaSgdState, sign_sgd, singa_sgd
from optaxdist.parallel import (
    REPLICA_AXIS,
    assert_replicas_identical,
    broadcast_from_root,
    global_replica_array,
    initialize_multihost,
    on_mesh,
    on_mpi,
    on_node,
    replicas_identical,
    replicate,
    simulate,
)
from optaxdist.partition import balanced_fragments, singa_partitions
from optaxdist.sharding import ModelSharding, on_shards
from optaxdist.topology import Topology
from optaxdist.transforms.agreed import apply_updates, sync_params
from optaxdist.transforms.allreduce import AllReduceState, allreduce
from optaxdist.transforms.averaged_iterate import (
    AveragedIterateState,
    averaged_iterate,
    averaged_params,
)
from optaxdist.transforms.compressed import (
    CompressedAllReduceState,
    ExactWarmupState,
    compressed_allreduce,
    exact_warmup,
)
from optaxdist.transforms.daso import DasoEvents, DasoState, HeatQuirks, daso
from optaxdist.transforms.demo import DemoState, demo
from optaxdist.transforms.des_loc import des_loc
from optaxdist.transforms.gossip import (
    PushSumState,
    consensus_distance,
    decentralized_sgd,
    sgp,
)
from optaxdist.transforms.local_sgd import average_params, local_sgd, sync_model_state
from optaxdist.transforms.loss_scale import (
    DynamicLossScaleState,
    dynamic_loss_scale,
    mlbench_loss_scale,
    scale_loss,
    skip_nonfinite,
)
from optaxdist.transforms.outer import (
    OuterState,
    SlowMoOuterState,
    diloco,
    diloco_outer_optimizer,
    outer_sync,
    slowmo,
    slowmo_outer_optimizer,
    streaming_diloco,
)
from optaxdist.transforms.partial import partial_average
from optaxdist.transforms.periodic import PeriodicState
from optaxdist.transforms.powersgd import PowerSgdState, powersgd
from optaxdist.transforms.sparseloco import sparseloco

__version__ = "0.1.0"

__all__ = [
    "allreduce",
    "AllReduceState",
    "apply_updates",
    "assert_replicas_identical",
    "average_params",
    "averaged_iterate",
    "averaged_params",
    "AveragedIterateState",
    "axis_hierarchy",
    "AxisComm",
    "balanced_fragments",
    "broadcast_from_root",
    "CheckpointMismatchError",
    "comm_stats",
    "CommLedger",
    "CommStats",
    "Communicator",
    "compress",
    "compressed_allreduce",
    "CompressedAllReduceState",
    "consensus_distance",
    "CrossComm",
    "daso",
    "DasoEvents",
    "DasoState",
    "decentralized_sgd",
    "demo",
    "DemoState",
    "des_loc",
    "diloco",
    "diloco_outer_optimizer",
    "dynamic_loss_scale",
    "DynamicLossScaleState",
    "exact_warmup",
    "ExactWarmupState",
    "global_replica_array",
    "HeatQuirks",
    "Hierarchy",
    "initialize_multihost",
    "KindTotals",
    "local_sgd",
    "mesh_hierarchy",
    "mlbench_loss_scale",
    "ModelSharding",
    "mpi_hierarchy",
    "MpiComm",
    "nnx_replica",
    "nnx_replicate",
    "nnx_step",
    "node_hierarchy",
    "NodeComm",
    "on_mesh",
    "on_mpi",
    "on_node",
    "on_shards",
    "outer_sync",
    "OuterState",
    "partial_average",
    "PeriodicState",
    "powersgd",
    "PowerSgdState",
    "PushSumState",
    "rank_directory",
    "REPLICA_AXIS",
    "replicas_identical",
    "replicate",
    "resize_replicas",
    "restore_checkpoint",
    "restore_stacked",
    "save_checkpoint",
    "scale_loss",
    "sgp",
    "sign_sgd",
    "SignSgdState",
    "simulate",
    "singa_partitions",
    "singa_sgd",
    "SingaSgdState",
    "skip_nonfinite",
    "slowmo",
    "slowmo_outer_optimizer",
    "sparseloco",
    "SlowMoOuterState",
    "SoloComm",
    "streaming_diloco",
    "sync_model_state",
    "sync_params",
    "Topology",
    "topology",
]
