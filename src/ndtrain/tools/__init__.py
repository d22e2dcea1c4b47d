"""The top floor: commands and tools that drive the trainer or the planner, or read what they
produce: `ndtrain train`'s planner glue (auto), `config check`, `verify`, `pipeline-report`,
`calibrate`, `report`, `generate`, `export` and `import`. Nothing below imports from here
(tests/test_layers.py checks it)."""
