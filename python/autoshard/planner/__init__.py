"""The plan: the planner's answer read into a frozen ShardingPlan, its JSON, printout, holdings, shape prediction and memory prediction, and the dry run that checks it."""
