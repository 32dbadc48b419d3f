"""Trace replay on a running kvfold: a workload's requests admitted by schedulers in
processes of their own and placed on the ranks, recorded, and compared across routers.

    kvfold.replay.trace_replay     replay(): the driver's loop over a trace (`kvfold replay`)
    kvfold.replay.compare          the same trace under several routers (`kvfold compare`)
    kvfold.replay.scheduler_actor  controllers and schedulers as Ray actors
                                   (start_controllers, start_schedulers)
"""
