"""The capture: a model's forward on meta recorded op by op as the graph the C++ planner reads."""
