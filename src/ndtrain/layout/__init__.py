"""Torch-free layout rules shared by the config, the runtime, the planner and verify."""
