"""The ground floor: the compiled library and its ops, numpy's split rule, styles, process groups and collectives, the per-model state, the synchronised generators."""
