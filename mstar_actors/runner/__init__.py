"""One rank's model runner and what it is built from.

- ``build.build_runner(config, info)``: the runner from the validated config
  and the model's facts, in named steps (load, pack, LoRA, KV cache, kernels,
  graphs).
- ``model_runner.ModelRunner``: runs one ``StepPlan`` at a time.
- ``step_graphs``: the CUDA graphs of decode steps and of mixed steps.
- ``device``: the device and dtype a rank serves on (torch alone, for what
  resolves them before any rank starts).
"""
