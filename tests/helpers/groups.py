"""The process groups a test hands to what it builds (a model never looks them up itself)."""


def current_groups():
    """The registry's process groups where a test world initialized them, else those of a world
    of one (a single process without torch.distributed)."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups import ProcessGroupCollection

    if ps.model_parallel_is_initialized():
        return ps.get_process_groups()
    return ProcessGroupCollection.world_of_one()
