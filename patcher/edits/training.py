"""Edits 2.1-2.8: megatron/training.py reports optimizer updates to TTP and starts it; 2.9-2.13
(ttp-patch's own): the in-memory recovery's hooks, the end of the job, the kept step's log."""

from __future__ import annotations

import ast
from typing import Optional, Sequence

import libcst as cst

from ..options import DEFAULT_PORT, Options
from .base import DecorateTopLevelDef, InsertAfterAnchor, ReplaceAnchor
from .statements import EMPTY_MODULE

FILE = "megatron/training.py"


class ImportTTPModules(InsertAfterAnchor):
    """After the last top-level import: megatron_ttp needs Megatron's modules loaded first."""

    id = "training/import-ttp"
    number = "2.1"
    file = FILE
    scope = None
    anchor = "from megatron.model.vision.knn_monitor import compute_feature_bank"
    inserted = "import mindio_ttp.framework_ttp as ttp\nimport mindio_ttp.megatron_ttp as mega\n"
    summary = "import mindio_ttp.framework_ttp as ttp / megatron_ttp as mega"


class LoadCheckpointThroughTTP(ReplaceAnchor):
    id = "training/ttp-load-checkpoint"
    number = "2.2"
    file = FILE
    scope = "setup_model_and_optimizer"
    anchor = "args.iteration = load_checkpoint(model, optimizer, opt_param_scheduler)"
    replacement = "args.iteration = mega.load_checkpoint(model, optimizer, opt_param_scheduler)"
    summary = "args.iteration = mega.load_checkpoint(...)"

    def rewrite(self, stmt: cst.BaseStatement) -> cst.BaseStatement:
        from .rewrites import QualifyLoadCheckpoint

        return stmt.visit(QualifyLoadCheckpoint())


class BarrierAfterGradReduce(InsertAfterAnchor):
    id = "training/barrier-after-reduce"
    number = "2.3"
    file = FILE
    scope = "train_step"
    anchor = "optimizer.reduce_model_grads(args, timers)"
    inserted = "# all rank need to barrier\ntorch.distributed.barrier()\n"
    summary = "barrier after reduce_model_grads"


class StartUpdatingOptimizerState(InsertAfterAnchor):
    id = "training/start-updating-os"
    number = "2.4"
    file = FILE
    scope = "train_step"
    anchor = "timers('optimizer', log_level=1).start(barrier=args.barrier_with_L1_time)"
    inserted = "ttp.ttp_start_updating_os(-1)\n"
    summary = "ttp_start_updating_os(-1) before optimizer.step"


class EndUpdatingOptimizerState(InsertAfterAnchor):
    id = "training/end-updating-os"
    number = "2.5"
    file = FILE
    scope = "train_step"
    anchor = "update_successful, grad_norm, num_zeros_in_grad = optimizer.step(args, timers)"
    inserted = """\
if hasattr(optimizer, 'increase_step'):
    optimizer.increase_step()
ttp.ttp_end_updating_os(optimizer.current_step)
"""
    summary = "increase_step + ttp_end_updating_os after optimizer.step"


class PersistTrain(DecorateTopLevelDef):
    id = "training/persist-train"
    number = "2.6"
    file = FILE
    scope = None
    def_name = "train"
    decorator = "ttp.ttp_to_persist"
    anchor = "def train("
    summary = "@ttp.ttp_to_persist on train()"


STARTUP_BLOCK = """\
# begin to init ttp processor & controller
cur_rank = torch.distributed.get_rank()
world_size: int = torch.distributed.get_world_size()
import os
masterIp = os.getenv('MASTER_ADDR', '127.0.0.1')
port = {port}
dp_ranks = mpu.get_data_parallel_all_rank()
if cur_rank == 0:
    ttp.ttp_init_controller(cur_rank, world_size, len(dp_ranks)//2, False)
    ttp.ttp_start_controller(masterIp, port)
ttp.ttp_init_processor(cur_rank, dp_ranks, len(dp_ranks), world_size, len(dp_ranks)//2, False)
ttp.ttp_start_processor(masterIp, port)
ttp.ttp_register_save_ckpt_handler(mega.ttp_save_checkpoint)
ttp.ttp_register_rename_handler(mega.rename_save_result)
"""
_PORT_POSITION = 4  # `port = 8000` is the block's fifth statement


class StartTTP(InsertAfterAnchor):
    """The start-up block in train(); `--port` changes only the `port = 8000` literal."""

    id = "training/start-ttp"
    number = "2.7"
    file = FILE
    scope = "train"
    anchor = "total_loss_dict = {}"
    summary = "controller/processor start-up block after total_loss_dict = {}"

    def inserted_source(self, opts: Options, followers: Sequence[cst.BaseStatement]) -> str:
        port = opts.port if opts.port is not None else _port_shown(followers)
        return STARTUP_BLOCK.format(port=port if port is not None else DEFAULT_PORT)


def _port_shown(followers: Sequence[cst.BaseStatement]) -> Optional[int]:
    """The integer a hand-set `port = N` line holds, so detection accepts any port."""
    if len(followers) <= _PORT_POSITION:
        return None
    tree = ast.parse(EMPTY_MODULE.code_for_node(followers[_PORT_POSITION]))
    if (
        len(tree.body) == 1
        and isinstance(tree.body[0], ast.Assign)
        and [ast.dump(t) for t in tree.body[0].targets] == [ast.dump(ast.Name("port", ast.Store()))]
        and isinstance(tree.body[0].value, ast.Constant)
        and type(tree.body[0].value.value) is int
    ):
        return tree.body[0].value.value
    return None


class SetCheckpointArgs(InsertAfterAnchor):
    id = "training/set-ckpt-args"
    number = "2.8"
    file = FILE
    scope = "train"
    anchor = "iteration += 1"
    inserted = "ttp.ttp_set_ckpt_args((iteration, model, optimizer, opt_param_scheduler))\n"
    summary = "ttp_set_ckpt_args(...) after iteration += 1 in train()"


class RecoverInMemory(DecorateTopLevelDef):
    """Not in the guide: after an in-memory recovery a survivor runs pretrain() again in its
    own process, around the model and optimizer it holds (docs/recovery.md)."""

    id = "training/in-memory-recovery"
    number = "2.9"
    file = FILE
    scope = None
    def_name = "pretrain"
    decorator = "mega.in_memory_recovery"
    anchor = "def pretrain("
    summary = "@mega.in_memory_recovery on pretrain(): survivors rejoin after a fault"


class ReuseModelOnRecovery(DecorateTopLevelDef):
    """Not in the guide: during that re-run, get_model() gives back the survivor's model."""

    id = "training/reuse-model-on-recovery"
    number = "2.10"
    file = FILE
    scope = None
    def_name = "get_model"
    decorator = "mega.reuse_on_recovery"
    anchor = "def get_model("
    summary = "@mega.reuse_on_recovery on get_model(): a survivor keeps its model"


class FinalCheckpointSaved(InsertAfterAnchor):
    """Not in the guide: pretrain()'s final save_checkpoint ends with a barrier of every rank
    after its last write, so past it the job is complete on disk: the runtime, held up to
    here by edit 2.9, stops, and ttprun learns that a worker lost from now on fails nothing
    (docs/recovery.md, "Every window of a Megatron job")."""

    id = "training/final-checkpoint-saved"
    number = "2.11"
    file = FILE
    scope = "pretrain"
    anchor = "save_checkpoint(iteration, model, optimizer, opt_param_scheduler)"
    inserted = "mega.final_checkpoint_saved(iteration)\n"
    summary = "mega.final_checkpoint_saved(iteration) after pretrain()'s final save"


class RecordStepLog(DecorateTopLevelDef):
    """Not in the guide: each rank keeps what training_log() was called with, and whether it
    got past the barrier before the print, so that after an in-memory recovery the kept
    step's log line and scalars appear exactly once (docs/recovery.md)."""

    id = "training/step-log"
    number = "2.12"
    file = FILE
    scope = None
    def_name = "training_log"
    decorator = "mega.step_log"
    anchor = "def training_log("
    summary = "@mega.step_log on training_log(): the kept step's log line survives a fault"


class KeepStepLosses(DecorateTopLevelDef):
    """Not in the guide: a train_step() that raises after its update (a peer lost in the
    parameter all-gather) leaves the step complete but never logged; its losses and gradient
    norm are kept, so its log line can still appear once after a recovery (docs/recovery.md)."""

    id = "training/step-losses"
    number = "2.13"
    file = FILE
    scope = None
    def_name = "train_step"
    decorator = "mega.step_losses"
    anchor = "def train_step("
    summary = "@mega.step_losses on train_step(): a step updated but not logged keeps its losses"


EDITS = [
    ImportTTPModules(),
    LoadCheckpointThroughTTP(),
    BarrierAfterGradReduce(),
    StartUpdatingOptimizerState(),
    EndUpdatingOptimizerState(),
    PersistTrain(),
    StartTTP(),
    SetCheckpointArgs(),
    RecoverInMemory(),
    ReuseModelOnRecovery(),
    FinalCheckpointSaved(),
    RecordStepLog(),
    KeepStepLosses(),
]
