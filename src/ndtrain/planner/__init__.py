"""Predict memory, step time, MFU, energy and goodput of parallel layouts; pick the best.

Pure Python: nothing here imports torch (measuring a machine with torch is `ndtrain calibrate`,
in ndtrain.tools). Entry points: `ndtrain plan`, `ndtrain goodput`, and `ndtrain.planner.api`
(auto_layout, predict, predict_step_time). The model is described in docs/planner.md.
"""
