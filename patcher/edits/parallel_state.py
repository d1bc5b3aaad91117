"""Edits 4.1-4.3: megatron/core/parallel_state.py exposes the data-parallel rank lists."""

from __future__ import annotations

from .base import InsertAfterAnchor, InsertBeforeTopLevelDef

FILE = "megatron/core/parallel_state.py"


class AddAllDataParallelRanksVariable(InsertAfterAnchor):
    id = "parallel-state/all-dp-ranks-var"
    number = "4.1"
    file = FILE
    scope = None
    anchor = "_GLOBAL_MEMORY_BUFFER = None"
    inserted = "all_data_parallel_group_ranks = None\n"
    summary = "module variable all_data_parallel_group_ranks"


class DeclareAllDataParallelRanksGlobal(InsertAfterAnchor):
    """Makes the list initialize_model_parallel builds a line later the module-level value."""

    id = "parallel-state/global-all-dp-ranks"
    number = "4.2"
    file = FILE
    scope = "initialize_model_parallel"
    anchor = "global _DATA_PARALLEL_GLOBAL_RANKS"
    inserted = "global all_data_parallel_group_ranks\n"
    summary = "global all_data_parallel_group_ranks in initialize_model_parallel"


class AddDataParallelRankGetters(InsertBeforeTopLevelDef):
    id = "parallel-state/dp-rank-getters"
    number = "4.3"
    file = FILE
    scope = None
    before_def = "model_parallel_is_initialized"
    anchor = "def model_parallel_is_initialized():"
    inserted = """\
def get_data_parallel_all_rank():
    assert _DATA_PARALLEL_GLOBAL_RANKS is not None, \\
        "Data parallel group is not initialized"
    return _DATA_PARALLEL_GLOBAL_RANKS

def get_all_data_parallel_ranks():
    return all_data_parallel_group_ranks
"""
    summary = "get_data_parallel_all_rank() and get_all_data_parallel_ranks()"


EDITS = [
    AddAllDataParallelRanksVariable(),
    DeclareAllDataParallelRanksGlobal(),
    AddDataParallelRankGetters(),
]
