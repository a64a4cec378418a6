"""A case served by processes that still hold models of earlier trials: the trial's warning line as
`Trainer.retarget` prints it from two ranks' reports (`zbench.engine.workers.carried_line`); then every step, and
exit 0."""

from _common import case_dir, run_all

from zbench.engine.workers import carried_line

print(carried_line(["actor rank 0: 1 DeepSpeedZeroOptimizer, 1 Qwen3ForCausalLM; 1.11 GB of parameters",
                    "actor rank 1: 1 DeepSpeedZeroOptimizer, 1 Qwen3ForCausalLM; 1.11 GB of parameters"]), flush=True)
run_all(case_dir())
