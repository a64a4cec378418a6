"""The single controller of one case: places the workers, then runs the PPO or GRPO step loop.

Each step: sample responses (gen) -> score them by rule (reward) -> actor log-probs (old_log_prob; skipped
where the update's own forward gives them exactly) -> reference log-probs (ref) -> values (PPO) -> advantages
(adv) -> critic update (PPO) -> actor update -> weights into the rollout replica (update_weights). Every phase
is timed as `timing_s/<phase>`; within gen, `perf/rollout_engine_s` is the slowest rank's time inside the rollout
engine's own generate call and `perf/rollout_sleep_s` its sleep after it (vLLM's; the graph loop's freeing of its KV
cache where `rollout.release_kv_cache`, whose mapping again before the next rollout is `perf/rollout_wake_s`, part
of the engine's time), so the rest of `timing_s/gen` is
the trainer's and Ray's; `perf/rollout_shared_rows` (the graph loop) how many rows read each prompt's keys once in
its decode steps (1: every row its own). With `trainer.critic_update` concurrent, the critic's update runs beside the
actor's update and weight push instead: `timing_s/update_critic` is then the critic's own time, and
`timing_s/critic_wait` what of it was left when the weights were in. With `overlap`, it runs behind the next
step's rollout (generation, reward, the actor's and the reference's passes), which never reads the critic, and the
next step waits for it before its values; a step's record is written once its critic update is in (during the next
step), so it always holds that update's statistics. In overlap, `timing_s/critic_wait` is all of the critic's update
that a step waited for: the step before's update left when its values were due, plus its own where it updates in
turns (a run's first and last step, a checkpoint's, a profiled one's), so the phases add up to the step.

    python -m zbench.engine results/<run>/<case>      # reads <case>/config.yaml
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from zbench.config import (
    ConfigError,
    RunConfig,
    auto_takes_graph_loop,
    effective_offload,
    load_case_config,
    trial_differences,
)
from zbench.engine import algos
from zbench.engine.batches import (
    PROMPT_WIDTH_MULTIPLE,
    gather,
    left_pad,
    mini_batch_tokens,
    pick,
    rollout_outputs,
    rollout_shards,
    sequence_batch,
    shard,
)
from zbench.engine.faults import maybe_inject
from zbench.engine.mps import SM_SHARE_ENV, MPSError, MPSServer
from zbench.engine.records import Records, peak_flops, training_flops, versions
from zbench.engine.reward import compute_score
from zbench.engine.trackers import Trackers
from zbench.procs import PROCESS_DIR_ENV, remove_ray_tmpdir, watch_supervisor
from zbench.runroot import casedir
from zbench.stacks import enable_stack_dumps

SYNTHETIC_DATA_SEED = 0  # the generated problem set is the same for every case; the case seed orders it


class PromptStream:
    """Tokenised prompts in a seeded order: step s takes positions [(s-1)B, sB) of the epoch permutations.

    The order is a pure function of (seed, step), so a resumed case sees exactly the prompts it would have.
    """

    def __init__(self, rows: list[dict[str, Any]], tokenizer: Any, batch: int, seed: int, shuffle: bool,
                 max_prompt_length: int):
        self.ids: list[list[int]] = []
        self.truths: list[str] = []
        for row in rows:
            text = tokenizer.apply_chat_template(list(row["prompt"]), add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) <= max_prompt_length:
                self.ids.append(ids)
                self.truths.append(str(row["reward_model"]["ground_truth"]))
        if len(self.ids) < batch:
            raise ConfigError("data", f"only {len(self.ids)} prompts fit data.max_prompt_length={max_prompt_length}; "
                                      f"a step needs trainer.train_batch_size={batch}")
        self.batch, self.seed, self.shuffle = batch, seed, shuffle
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        if epoch not in self._perms:
            n = len(self.ids)
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
                self._perms[epoch] = torch.randperm(n, generator=g).tolist()
            else:
                self._perms[epoch] = list(range(n))
        return self._perms[epoch]

    def indices(self, step: int) -> list[int]:
        """Dataset indices of the prompts of `step` (1-based)."""
        n = len(self.ids)
        return [self._perm(p // n)[p % n] for p in range((step - 1) * self.batch, step * self.batch)]


def mean_of(dicts: list[dict[str, float]]) -> dict[str, float]:
    """Average per-rank metric dicts key by key."""
    keys = {k for d in dicts for k in d}
    return {k: sum(d[k] for d in dicts if k in d) / sum(1 for d in dicts if k in d) for k in keys}


def merge_memory(policy: list[dict[str, float]], critic: list[dict[str, float]]) -> list[dict[str, float]]:
    """Each rank's memory report over its actor's and critic's processes: per-process figures add up; the
    device-wide ones (`device_*`) are of the same GPU, so the larger stands."""
    out = [dict(m) for m in policy]
    for rank, m in enumerate(critic):
        for k, v in m.items():
            prev = out[rank].get(k, 0.0)
            out[rank][k] = max(prev, v) if k.startswith("device_") else prev + v
    return out


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    return {f"{prefix}/mean": x.float().mean().item(), f"{prefix}/max": x.float().max().item(),
            f"{prefix}/min": x.float().min().item()}


@dataclass
class HeldStep:
    """A step whose critic update runs behind the next step's rollout (`trainer.critic_update` overlap): its
    record waits for that update's statistics, its time and the critic's memory."""

    step: int
    runs: list[Any]  # the critic's update on each rank (`WorkerGroup.submit_sharded`)
    metrics: dict[str, float]  # the step's own, the critic's update aside
    policy_memory: list[dict[str, float]]  # the actor's processes' memory report of the step, per rank

    def ready(self) -> bool:
        """Whether the critic's update is in on every rank (without waiting)."""
        import ray

        return not ray.wait(self.runs, num_returns=len(self.runs), timeout=0)[1]


class Trainer:
    """Drives one case from its directory."""

    def __init__(self, case_dir: Path, process_dir: Path | None = None):
        self.case_dir = case_dir
        # where what belongs to the processes rather than to the case lives (Ray's temp folder, the workers' stack
        # registrations): the case's own folder, or a session's, whose processes serve one trial after another
        self.process_dir = process_dir or case_dir
        self.session: dict[str, Any] | None = None  # which session and trial, where a session serves this case
        self.cfg: RunConfig = load_case_config(case_dir / casedir.CONFIG, complete=True)
        want = self.cfg.trainer.device
        if want == "cuda" and not torch.cuda.is_available():
            raise ConfigError("trainer.device", "'cuda' asked for, but torch sees no CUDA device; use 'auto' or 'cpu'")
        self.on_cuda = self.cfg.trainer.uses_cuda()
        # trainer.critic_sm_percent: the case's private MPS server, found before anything starts, started in `open`
        self.mps = self._mps_server() if self.cfg.trainer.critic_sm_percent else None
        from zbench.engine.vllm_rollout import installed_vllm, select_backend

        # a backend that cannot run here is a config error before anything starts
        self.backend = select_backend(self.cfg.rollout.backend, self.on_cuda, installed_vllm(), torch.__version__,
                                      self.on_cuda and auto_takes_graph_loop(self.cfg))
        if self.backend != "vllm" and self.cfg.rollout.tensor_parallel_size != 1:
            raise ConfigError("rollout.tensor_parallel_size", f"only the vllm backend shards generation; the "
                                                              f"{self.backend} backend runs a whole replica per rank: "
                                                              "use 1, or rollout.backend=vllm")
        self.records = Records(case_dir, console="console" in self.cfg.trainer.logger)
        self.plan = self.cfg.batch_plan()
        self.timing: dict[str, float] = {}
        self.held: HeldStep | None = None  # trainer.critic_update overlap: the step waiting for its critic update
        self.first_step = 1  # of this run (after a resume, the step after its checkpoint's)
        self._longest_critic_update = 0.0  # seconds, of this run: bounds the wait for a held step after a failure
        self._trackers: Trackers | None = None
        self._behind: HeldStep | None = None  # the step just run, its critic update behind the next rollout

    @contextmanager
    def _timed(self, phase: str):
        start = time.perf_counter()
        yield
        self.timing[f"timing_s/{phase}"] = time.perf_counter() - start

    # ------------------------------------------------------------------------------------------- set-up
    def _prompts(self, tokenizer: Any) -> PromptStream:
        from zbench.data import load_prompts, synthetic_problems

        d = self.cfg.data
        rows = (synthetic_problems(d.synthetic_size, SYNTHETIC_DATA_SEED, "train") if d.train_files == "synthetic"
                else load_prompts(d.train_files))
        return PromptStream(rows, tokenizer, self.cfg.trainer.train_batch_size, self.cfg.seed, d.shuffle,
                            d.max_prompt_length)

    def _start_workers(self) -> None:
        from zbench.engine.cluster import Placement, cpu_threads_per_rank, start_ray
        from zbench.engine.workers import CriticWorker, PolicyWorker

        t = self.cfg.trainer
        start_ray(self.process_dir, t.world_size, self.on_cuda)
        self.records.beat()
        critic = self.cfg.needs_critic
        self.placement = Placement(t.world_size, self.on_cuda, groups_per_bundle=2 if critic else 1)
        # CPU workers take the configured threads; a GPU rank takes its host's share of the cores, which CPU Adam
        # needs when offloading: all of it for each of its workers where they take turns or the critic's update runs
        # beside the rollout (overlap: generation's host work is one thread's), half where the actor and the critic
        # update at the same time (trainer.critic_update concurrent)
        threads = t.torch_threads
        if self.on_cuda:
            share = cpu_threads_per_rank(min(t.world_size, torch.cuda.device_count()))
            threads = max(1, share // 2) if critic and t.critic_update == "concurrent" else share
        env = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads),
               PROCESS_DIR_ENV: str(self.process_dir.resolve())}
        if not self.on_cuda:
            env["DS_ACCELERATOR"] = "cpu"
        critic_env = dict(env)
        if t.critic_sm_percent:
            env, critic_env = self._start_mps(env)
        args = (self.cfg, str(self.case_dir.resolve()), str(self.model_path))
        self.policy = self.placement.group(PolicyWorker, env, *args)
        self.critic = self.placement.group(CriticWorker, critic_env, *args) if critic else None
        self.info = self.policy.call("setup")[0]
        self.info["rank_nodes"] = self.policy.nodes()  # the Ray node of each rank, for the result
        self.records.beat()
        if self.critic:
            self.info["critic"] = self.critic.call("setup")[0]
        self.records.beat()
        if self.mps is not None:
            self.info["mps"] = self._check_mps_clients()

    def _mps_server(self) -> MPSServer:
        """The case's MPS server (`trainer.critic_sm_percent`), its pipe in the case's Ray folder; a host or cluster
        it cannot run on is a config error."""
        from zbench.engine.cluster import ray_tmpdir

        where = "" if self.on_cuda else "this host has no CUDA device"
        if not where and os.environ.get("ZBENCH_RAY_ADDRESS", "").strip():
            where = "this case runs on a Ray cluster (ZBENCH_RAY_ADDRESS), whose other nodes it cannot start it on"
        if where:
            raise ConfigError("trainer.critic_sm_percent", f"runs the case's GPU processes through a private NVIDIA "
                                                           f"MPS server, but {where}: use 0")
        try:
            return MPSServer(ray_tmpdir(self.process_dir) / "mps", self.process_dir / "mps")
        except MPSError as err:  # no control program: the message names it and the way out
            raise ConfigError("trainer.critic_sm_percent", str(err)) from None

    def _start_mps(self, env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
        """Start the case's MPS server; the workers' environments: the actor's with the server's pipe, the critic's
        with its SM cap as well."""
        server = self.mps
        assert server is not None
        server.start()  # `close` stops it, whatever interrupts this
        print(f"[zbench] NVIDIA MPS server at {server.pipe}: the critic's kernels use at most "
              f"{self.cfg.trainer.critic_sm_percent} % of each GPU's SMs", flush=True)
        shared = {**env, **server.client_env()}
        return shared, {**shared, SM_SHARE_ENV: str(self.cfg.trainer.critic_sm_percent)}

    def _check_mps_clients(self) -> dict[str, Any]:
        """Every worker has its model on the GPU by now; a worker that did not reach the MPS server would run its
        kernels in time slices while the case says otherwise, so that is an error. What took effect, for the result."""
        assert self.mps is not None
        workers = [pid for g in (self.policy, self.critic) if g is not None for pid in g.pids()]
        connected = self.mps.clients()
        missing = sorted(set(workers) - connected)
        if missing:
            raise RuntimeError(f"trainer.critic_sm_percent: worker processes {missing} of {sorted(workers)} did not "
                               f"connect to the case's MPS server (its logs: {self.mps.logs}); their "
                               "kernels would take time slices, not run beside each other")
        return {"critic_sm_percent": self.cfg.trainer.critic_sm_percent, "client_processes": len(workers)}

    # ------------------------------------------------------------------------------------------- one step
    def step(self, step: int) -> dict[str, float]:
        cfg, n, dp = self.cfg, self.cfg.rollout.n, self.cfg.trainer.world_size
        self.timing = {}
        metrics: dict[str, float] = {}
        profiled = step == cfg.trainer.profile_step
        groups = [g for g in (self.policy, self.critic) if g is not None]
        if profiled:
            for g in groups:
                g.call("profile_start")
        t0 = time.perf_counter()
        idx = self.prompts.indices(step)
        prompt_ids = [self.prompts.ids[i] for i in idx for _ in range(n)]
        truths = [self.prompts.truths[i] for i in idx for _ in range(n)]
        group_ids = torch.arange(len(idx)).repeat_interleave(n)
        # a static KV cache compiles per shape: bucket prompt widths so a handful of shapes cover a run (the graph
        # loop with the Triton attention pads every batch further, to one width: HFRollout.prompt_width)
        static = self.backend == "hf" and (cfg.rollout.static_cache or cfg.rollout.cuda_graph)
        p_ids, p_mask = left_pad(prompt_ids, self.pad_id, multiple=PROMPT_WIDTH_MULTIPLE if static else 1)

        with self._timed("gen"):
            tp = cfg.rollout.tensor_parallel_size
            prompts = rollout_shards({"input_ids": p_ids, "attention_mask": p_mask}, dp, tp)
            gen = rollout_outputs(self.policy.call_sharded("generate", prompts, step), tp)
        self._settle_held(block=False)  # the step before's critic update mostly finishes within the rollout
        for part in ("engine", "sleep", "wake"):  # the slowest rank's seconds inside the rollout engine, its sleep
            # and (the graph loop's, inside the engine's) the mapping of its KV cache again
            if f"rollout_{part}_s" in gen:
                metrics[f"perf/rollout_{part}_s"] = float(gen.pop(f"rollout_{part}_s").max())
        if "rollout_shared_rows" in gen:  # the graph loop's runs of rows that read their prompt's keys once, least
            metrics["perf/rollout_shared_rows"] = float(gen.pop("rollout_shared_rows").min())
        responses, r_mask = gen["responses"], gen["response_mask"]
        batch = sequence_batch(p_ids, p_mask, responses, r_mask)
        if "rollout_log_probs" in gen:
            batch["rollout_log_probs"] = gen["rollout_log_probs"]
        fwd_keys = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")

        with self._timed("reward"):
            texts = [self.tokenizer.decode(r[m.bool()], skip_special_tokens=True) for r, m in zip(responses, r_mask, strict=True)]
            rc = cfg.reward
            scores = torch.tensor([compute_score(t, g, method=rc.method, format_score=rc.format_score,
                                                 correct_score=rc.correct_score) for t, g in zip(texts, truths, strict=True)])
        if cfg.old_log_prob_pass:  # otherwise the update's own forward gives them (see RunConfig.old_log_prob_pass)
            with self._timed("old_log_prob"):
                batch.update(gather(self.policy.call_sharded("compute_log_prob", shard(pick(batch, *fwd_keys), dp))))
        if cfg.needs_reference:
            with self._timed("ref"):
                batch.update(gather(self.policy.call_sharded("compute_ref_log_prob", shard(pick(batch, *fwd_keys), dp))))
        if self.critic:
            self._settle_held(block=True)  # the step before's critic update, behind this rollout
            with self._timed("values"):
                batch.update(gather(self.critic.call_sharded("compute_values", shard(pick(batch, *fwd_keys), dp))))

        with self._timed("adv"):
            token_scores = algos.outcome_to_token_scores(scores, r_mask)
            if cfg.algo.use_kl_in_reward:
                rewards, kl_mean = algos.apply_kl_in_reward(token_scores, batch["old_log_probs"], batch["ref_log_probs"],
                                                            r_mask, cfg.algo.kl_coef, cfg.algo.kl_penalty)
                metrics["actor/reward_kl_penalty"] = float(kl_mean)
            else:
                rewards = token_scores
            adv, ret = algos.compute_advantages(cfg.adv_estimator, rewards, r_mask, values=batch.get("values"),
                                                group_ids=group_ids, gamma=cfg.algo.gamma, lam=cfg.algo.lam,
                                                norm_by_std=cfg.algo.norm_adv_by_std_in_grpo)
            batch.update(advantages=adv, returns=ret)
        # what a token-mean loss divides by: the response tokens of each row's optimizer step, over all ranks
        batch["step_tokens"] = mini_batch_tokens(r_mask, dp, self.cfg.batch_plan().mini_batch_sequences // dp)

        critic_runs: list[Any] = []  # the critic's update, running beside the actor's (trainer.critic_update)
        behind = self._critic_update_behind(step)
        if self.critic:
            critic_shards = shard(pick(batch, *fwd_keys, "values", "returns", "step_tokens"), dp)
            if cfg.trainer.critic_update == "concurrent":
                critic_runs = self.critic.submit_sharded("update_critic", critic_shards)
            elif not behind:
                with self._timed("update_critic"):
                    metrics.update(self._critic_stats(self.critic.call_sharded("update_critic", critic_shards)))
                self._longest_critic_update = max(self._longest_critic_update, self.timing["timing_s/update_critic"])
                if cfg.trainer.critic_update == "overlap":  # in turns this step: all of it waited for
                    self._add_critic_wait(self.timing["timing_s/update_critic"])
        actor_keys = ((*fwd_keys, "advantages", "step_tokens") + (("old_log_probs",) if cfg.old_log_prob_pass else ())
                      + (("ref_log_probs",) if cfg.actor.use_kl_loss else ()))
        with self._timed("update_actor"):
            outs = self.policy.call_sharded("update_actor", shard(pick(batch, *actor_keys), dp))
        if not cfg.old_log_prob_pass:  # the update's own log-probs, which the skipped pass would have given
            batch["old_log_probs"] = torch.cat([out.pop("old_log_probs") for out in outs])
        metrics.update(mean_of(outs))
        if "rollout_log_probs" in batch:  # how far the rollout engine's sampling log-probs are from the actor's
            diff = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs()[r_mask.bool()]
            metrics["actor/rollout_logprob_diff/mean"] = diff.mean().item()
            metrics["actor/rollout_logprob_diff/max"] = diff.max().item()
        with self._timed("update_weights"):
            self.policy.call("sync_weights")
        if critic_runs:
            # what of the critic's update the actor's update and weight push did not cover
            with self._timed("critic_wait"):
                outs = self.critic.collect(critic_runs)
            metrics.update(self._critic_stats(outs))
            # the critic's own time, beside the actor's: ranks' slowest
            self.timing["timing_s/update_critic"] = max(out["seconds"] for out in outs)
        critic_behind = (  # started last, so nothing of this step waits on it: the next step's values do; the critic
            # reports its memory at the end of the update, as nothing may call it before the update is done
            self.critic.submit_sharded("update_critic", critic_shards, True) if behind else None)
        if self.critic and cfg.trainer.critic_update == "overlap":
            self.timing.setdefault("timing_s/critic_wait", 0.0)
        self.timing["timing_s/step"] = time.perf_counter() - t0
        if profiled:
            metrics["perf/profiled"] = 1.0  # slower than the others: step means leave it out
            self._print_profiles(step, groups)

        metrics.update(self._batch_metrics(batch, scores, rewards, adv, ret))
        metrics.update(self.timing)
        policy_memory = self.policy.call("memory")
        if critic_behind is not None:  # a critic still updating reports its memory once it is done
            self._behind = HeldStep(step, critic_behind, metrics, policy_memory)
            mems = policy_memory
        else:
            mems = merge_memory(policy_memory, self.critic.call("memory")) if self.critic else policy_memory
        metrics.update(self._perf_metrics(batch))
        metrics.update(self._memory_metrics(mems))
        for i in range(min(cfg.trainer.log_samples, len(texts))):
            print(f"[sample] score={scores[i].item():g} truth={truths[i]} response={texts[i]!r}", flush=True)
        return metrics

    def _critic_update_behind(self, step: int) -> bool:
        """Whether this step's critic update runs behind the next step's rollout (`trainer.critic_update` overlap):
        never on the first step of a run (its update compiles kernels and grows memory pools, which the next step
        would carry instead: on 2 x H200 the second step took 10.6 s), the last, a checkpoint's (which saves the
        updated critic) or next to a profiled one (whose profile would hold the other step's update)."""
        t = self.cfg.trainer
        return (self.critic is not None and t.critic_update == "overlap" and self.first_step < step < self.cfg.steps
                and not (t.save_freq and step % t.save_freq == 0) and t.profile_step not in (step, step + 1))

    def _add_critic_wait(self, seconds: float) -> None:
        key = "timing_s/critic_wait"
        self.timing[key] = self.timing.get(key, 0.0) + seconds

    def _settle_held(self, block: bool) -> None:
        """Record the held step once its critic update is in: waiting for it (`block`, timed as this step's
        `critic_wait`), or only if it already is."""
        if self.held is None or (not block and not self.held.ready()):
            return
        start = time.perf_counter()
        self._write_held()
        self._add_critic_wait(time.perf_counter() - start)

    def _write_held(self, timeout: float | None = None) -> None:
        """Wait for the held step's critic update (up to `timeout` s), add its statistics, its time (ranks'
        slowest) and the critic's memory report to the held step's metrics, and record the step."""
        import ray

        held = self.held
        assert held is not None and self._trackers is not None
        self.held = None
        outs = ray.get(held.runs, timeout=timeout)
        critic_memory = [out.pop("memory") for out in outs]
        held.metrics.update(self._critic_stats(outs))
        held.metrics["timing_s/update_critic"] = max(out["seconds"] for out in outs)
        self._longest_critic_update = max(self._longest_critic_update, held.metrics["timing_s/update_critic"])
        held.metrics.update(self._memory_metrics(merge_memory(held.policy_memory, critic_memory)))
        self._trackers.log(held.step, self.records.step(held.step, held.metrics))

    def _record(self, step: int, metrics: dict[str, float]) -> None:
        """Record the step, or hold its record while its critic update runs behind the next step's rollout."""
        assert self._trackers is not None and self.held is None  # the step's values settled the one before
        if self._behind is not None:
            self.held, self._behind = self._behind, None
            self.records.beat()
        else:
            self._trackers.log(step, self.records.step(step, metrics))

    def _record_held_after_failure(self, interrupted: bool) -> None:
        """A step failed while the step before it was held: that step is still recorded once its critic update is
        in (it never reads what the failed step did), waiting up to four times the longest critic update so far
        (a minute at least); after an interrupt, only if it already is."""
        held = self.held
        if held is None:
            return
        try:
            if interrupted and not held.ready():
                print(f"[zbench] step {held.step} not recorded: interrupted before its critic update finished",
                      flush=True)
                return
            self._write_held(timeout=None if interrupted else max(60.0, 4 * self._longest_critic_update))
        except Exception as err:
            print(f"[zbench] step {held.step} not recorded: {err!r}", flush=True)
        finally:
            self.held = None

    @staticmethod
    def _critic_stats(outs: list[dict[str, float]]) -> dict[str, float]:
        """The ranks' mean critic statistics, without the seconds each rank's update took."""
        return mean_of([{k: v for k, v in out.items() if k != "seconds"} for out in outs])

    def _print_profiles(self, step: int, groups: list[Any]) -> None:
        """Stop every worker's profiler (each writes its files under <case>/profile/) and print its phase lines."""
        for g in groups:
            for rank, phases in enumerate(g.call("profile_stop", step)):
                for p in phases:
                    print(f"[profile] step {step} {g.name} rank {rank} {p['phase']}: {p['line']}", flush=True)

    def _batch_metrics(self, batch: dict, scores: torch.Tensor, rewards: torch.Tensor, adv: torch.Tensor,
                       ret: torch.Tensor) -> dict[str, float]:
        mask = batch["response_mask"]
        lengths = mask.sum(-1).float()
        out = {**_stats("critic/score", scores),
               "critic/rewards/mean": rewards.sum(-1).mean().item(),
               "critic/advantages/mean": algos.masked_mean(adv, mask).item(),
               "critic/returns/mean": algos.masked_mean(ret, mask).item(),
               **_stats("response_length", lengths),
               "response_length/clip_ratio": (lengths >= self.cfg.rollout.max_new_tokens).float().mean().item(),
               "prompt_length/mean": (batch["attention_mask"].sum(-1).float() - lengths).mean().item()}
        out.pop("response_length/min")
        if "values" in batch:
            out["critic/values/mean"] = algos.masked_mean(batch["values"], mask).item()
        return out

    def _memory_metrics(self, mems: list[dict[str, float]]) -> dict[str, float]:
        """The step's memory metrics from each rank's memory report (its processes' merged)."""
        out: dict[str, float] = {}
        if self.on_cuda:
            out["perf/max_memory_allocated_gb"] = max(m["allocated_gb"] for m in mems)
            out["perf/max_memory_reserved_gb"] = max(m["reserved_gb"] for m in mems)
            out["perf/device_memory_used_gb"] = max(m["device_used_gb"] for m in mems)
            for phase in ("gen", "train"):  # which phase holds the peak
                if any(f"device_{phase}_gb" in m for m in mems):
                    out[f"perf/device_memory_{phase}_gb"] = max(m.get(f"device_{phase}_gb", 0.0) for m in mems)
        rss = sum(m["rss_gb"] for m in mems) + psutil.Process().memory_info().rss / 2**30
        out["perf/cpu_memory_used_gb"] = rss
        out["perf/gc_pause_s"] = max(m["gc_pause_s"] for m in mems)  # a rank's workers pause one after another
        return out

    def _perf_metrics(self, batch: dict) -> dict[str, float]:
        dp = self.cfg.trainer.world_size
        tokens = int(batch["attention_mask"].sum())
        out = {"perf/total_num_tokens": float(tokens),
               "perf/throughput": tokens / (self.timing["timing_s/step"] * dp)}
        peak = peak_flops(self.info.get("gpu_name"))
        # beside the critic's update (trainer.critic_update concurrent) the actor's shares its GPU: its time is not
        # the actor's alone, and no actor MFU is recorded
        alone = not (self.critic and self.cfg.trainer.critic_update == "concurrent")
        if peak and alone and self.timing.get("timing_s/update_actor"):
            epochs = self.cfg.actor.ppo_epochs
            flops = epochs * training_flops(self.info["params"], self.model_config,
                                            batch["attention_mask"].sum(-1).tolist(), int(batch["response_mask"].sum()))
            out["perf/mfu/actor"] = flops / (self.timing["timing_s/update_actor"] * dp * peak)
        return out

    # ------------------------------------------------------------------------------------------- checkpoints
    @property
    def ckpt_dir(self) -> Path:
        return casedir.checkpoint_dir(self.case_dir)

    def save(self, step: int) -> None:
        tag = f"step_{step}"
        self.policy.call("save", str(self.ckpt_dir / "actor"), tag)
        if self.critic:
            self.critic.call("save", str(self.ckpt_dir / "critic"), tag)
        # written last: a checkpoint is usable only once this names it
        casedir.write_checkpoint_state(self.case_dir, {"step": step, "tag": tag, "seed": self.cfg.seed})
        print(f"[ckpt] saved {tag}", flush=True)

    def restore(self) -> int:
        state = casedir.read_checkpoint_state(self.case_dir)
        if state is None:
            return 0
        self.policy.call("load", str(self.ckpt_dir / "actor"), state["tag"])
        if self.critic:
            self.critic.call("load", str(self.ckpt_dir / "critic"), state["tag"])
        self.policy.call("sync_weights")
        self.records.truncate_after(state["step"])
        print(f"[ckpt] resumed from {state['tag']}", flush=True)
        return int(state["step"])

    # ------------------------------------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        """Train the case: start its workers, run its steps (from its checkpoint, if any), record its result."""
        try:
            self.open()
            return self.train()
        finally:
            self.close()

    def open(self) -> None:
        """What every step needs, once per process: the tokenizer, the prompts, Ray and the workers."""
        from transformers import AutoConfig, AutoTokenizer

        from zbench.models import resolve_model, special_ids

        self.started = time.time()
        self.model_path = resolve_model(self.cfg.model.path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model_config = AutoConfig.from_pretrained(self.model_path)
        self.pad_id, _ = special_ids(str(self.model_path))
        self.prompts = self._prompts(self.tokenizer)
        self.policy = self.critic = None
        self._start_workers()

    def retarget(self, case_dir: Path) -> None:
        """Serve `case_dir` next, a trial of the case this process was opened for at another batch geometry
        (`zbench.engine.session`): the workers build their models again for it (`reconfigure`), the rollout
        engine and everything else stay. Any other difference is a config error naming the keys."""
        cfg = load_case_config(case_dir / casedir.CONFIG, complete=True)
        if differ := trial_differences(self.cfg, cfg):
            raise ConfigError(differ[0], f"{case_dir.name} differs from {self.cfg.name}, whose processes serve it, "
                                         f"in {', '.join(differ)}; a trial may change only its batch geometry")
        self.case_dir, self.cfg, self.plan = case_dir, cfg, cfg.batch_plan()
        self.records = Records(case_dir, console="console" in cfg.trainer.logger)
        self.started = time.time()
        self.records.beat()
        groups = [g for g in (self.policy, self.critic) if g is not None]
        # all released before any rebuilds, as a new process starts with nothing; what any process still holds of
        # its models of earlier trials counts in this trial's memory: the trial's log and result say so
        from zbench.engine.workers import carried_line

        carried = [report for group in groups for report in group.call("release") if report]
        self.info["carried_from_earlier_trials"] = carried
        if carried:
            print(carried_line(carried), flush=True)
        where = str(case_dir.resolve())
        self.info.update(self.policy.call("reconfigure", cfg, where)[0])
        self.records.beat()
        if self.critic:
            self.info["critic"] = self.critic.call("reconfigure", cfg, where)[0]
        self.records.beat()

    def train(self) -> dict[str, Any]:
        """The case's steps, from its checkpoint if it has one, and its result."""
        cfg = self.cfg
        offload = effective_offload(cfg.zero.stage, cfg.zero.offload)
        print(f"[zbench] case {cfg.name}: {cfg.algorithm} zero{cfg.zero.stage} offload asked={cfg.zero.offload} "
              f"effective={offload.label} world_size={cfg.trainer.world_size} "
              f"device={'cuda' if self.on_cuda else 'cpu'} model={self.model_path}", flush=True)
        trackers = Trackers(cfg, self.case_dir)
        completed = False
        try:
            start_step = self.restore()
            print(f"[zbench] workers ready: {self.info}", flush=True)
            self.held = self._behind = None
            self.first_step, self._trackers = start_step + 1, trackers
            for step in range(start_step + 1, cfg.steps + 1):
                try:
                    maybe_inject(self, step)  # trainer.fault, first attempt only
                    metrics = self.step(step)
                except BaseException as err:
                    self._record_held_after_failure(interrupted=not isinstance(err, Exception))
                    raise
                self._record(step, metrics)
                if cfg.trainer.save_freq and (step % cfg.trainer.save_freq == 0 or step == cfg.steps):
                    self.save(step)
            completed = True
            result = {
                "steps_completed": cfg.steps, "steps_target": cfg.steps, "offload_effective": offload.label,
                "rollout_backend": self.info["backend"], "rollout_engine": self.info.get("engine"),
                "world_size": cfg.trainer.world_size,
                "wall_s": time.time() - self.started, "versions": versions(),
                "device": "cuda" if self.on_cuda else "cpu", "gpu_name": self.info.get("gpu_name"),
                "optimizer": self.info.get("optimizer"), "dtype": self.info.get("dtype"),
                # what the optimizer steps checked gradients with (`zero.fused_grad_checks`): actor, critic
                "grad_checks": self.info.get("grad_checks"),
                **({"critic_grad_checks": self.info["critic"].get("grad_checks")} if "critic" in self.info else {}),
                "params": self.info.get("params"), "resumed_from_step": start_step,
                "fused_ops": self.info.get("fused_ops"), "compiled_layers": self.info.get("compiled_layers"),
                "fused_head": self.info.get("fused_head"), "head_loss_in_forward": self.info.get("head_loss_in_forward"),
                "trackers": trackers.close(completed),
                "old_log_prob_pass": cfg.old_log_prob_pass, "rank_nodes": self.info["rank_nodes"],
                "worker_niceness": self.info.get("niceness"),
                **({"vllm_model_runner": self.info["model_runner"]} if self.info.get("model_runner") else {}),
                **({"graph_decode_attention": self.info["decode_attention"],
                    "graph_merged_projections": self.info.get("merged_projections"),
                    "graph_decode_kernels": self.info.get("decode_kernels"),
                    "graph_steps_per_graph": self.info.get("steps_per_graph"),
                    "graph_prompt_width": self.info.get("prompt_width"),
                    "graph_sampling": self.info.get("sampling"), "graph_kv_cache": self.info.get("kv_cache"),
                    "graph_prefill": self.info.get("prefill")}
                   if self.info.get("decode_attention") else {}),
                **({"mps": self.info["mps"]} if "mps" in self.info else {}),
                **({"session": self.session} if self.session else {}),
            }
            self.records.result(result)
            return result
        finally:
            trackers.close(completed)

    def close(self) -> None:
        """Stop the workers, the placement, Ray (a private Ray's folder too) and the MPS server; safe after a partial
        `open`."""
        import ray

        if not ray.is_initialized():
            self._stop_mps()
            return
        try:
            for group in (self.policy, self.critic):
                if group is not None:
                    try:
                        group.call("shutdown")
                    except Exception as err:  # a dead worker must not stop the others from being cleaned up
                        print(f"[zbench] {group.name} shutdown: {err}", flush=True)
                    group.kill()
            if getattr(self, "placement", None) is not None:
                self.placement.remove()
            ray.shutdown()
        finally:
            self._stop_mps()  # its clients are gone with the workers; its pipe lives in the Ray folder
            # a private Ray's folder goes with it, also when the engine runs without the launcher (which removes it
            # too)
            remove_ray_tmpdir(self.process_dir)

    def _stop_mps(self) -> None:
        if self.mps is not None:
            self.mps.stop()
            self.mps = None


def main(case_dir: str) -> int:
    """Train the case in `case_dir`; exit codes: 0 done, 1 failure, 2 config error."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    enable_stack_dumps(case_dir)  # a timeout asks for this process's stacks before killing it
    watch_supervisor(Path(case_dir))  # the harness gone (killed, hung up): the case goes with it
    try:
        trainer = Trainer(Path(case_dir))
        trainer.run()
    except ConfigError as err:
        print(f"ConfigError: {err}", flush=True)
        return 2
    return 0
