"""The bundled PPO/GRPO engine: one case, from its `config.yaml` to its metrics and final record.

    python -m zbench.engine <case_dir>       # what the harness starts, one process per case

Modules, in the order a step uses them: `trainer` (the single controller and its step loop), `cluster` (Ray
placement), `workers` (actor, reference, rollout and critic workers), `batches` (how a step's sequences are laid out
and split), `rollout` / `vllm_rollout` (generation), `reward`, `algos` (pure PPO/GRPO maths), `ds_config` (DeepSpeed
configs), `fused` (leaner RMSNorm/SwiGLU autograd), `profiling`, `records` (what a step leaves in the case dir);
and for the ops DeepSpeed JIT-builds and loads in each worker, `build_lock` (torch's build lock, naming its holder)
and `cpu_info` (the CPU description the op builders ask for, probed once per boot).

What the rest of zbench may use: `python -m zbench.engine` itself; and for the bare-DeepSpeed floors and benchmarks
(`zbench.bench`, `benchmarks/`), which must run the engine's own code to measure it, `ds_config.training_config`,
`fused.fuse`, `cluster.cpu_threads_per_rank` / `cluster.free_port`, `rollout.GraphDecoder`, `algos`, the `batches`
helpers, `build_lock.install` / `cpu_info.install` (also `make install`, which builds the CPU ops once)
and the worker classes. The harness and the analysis never import the engine: they meet it in the case
directory (`zbench.runroot.casedir`).
"""
