"""Planning without a cluster: the run plan, the memory/FLOP/communication estimators, the dry run, the layout planner."""
