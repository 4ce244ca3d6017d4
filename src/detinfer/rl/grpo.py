"""`GRPOTrainer`: sampler and trainer in one process, on one set of weights.

    from detinfer.rl import GRPOTrainer, RLConfig
    trainer = GRPOTrainer("path/to/model", RLConfig(task="addition", steps=50), arm="deterministic")
    for _ in range(trainer.config.steps):
        print(trainer.step())          # reward, response length, mismatch, weights hash, timings

One step: draw the step's prompts (a pure function of (seed, step); a dataset in seeded epochs) -> the
engine samples `n_samples` completions per prompt (temperature / top-p / top-k), each request seeded from
(seed, step, prompt) and each sample drawn from (that seed, position, sample index), with the sampler's
logprob of every token -> the reward functions score them (a failing one scores its samples 0) ->
group-relative advantages -> `ppo_epochs` passes over the rollout in mini-batches, each one optimizer
update: the trainer re-scores the mini-batch's completion tokens with autograd (logits for those rows
only: `score(..., positions=)`), the clipped objective (rl/loss.py) takes the sampler's logprobs as the old
policy's, backward in fixed micro-batches, clip, AdamW step (fused on CUDA: train/optim.py's `adamw`) ->
`push_weights()`: 16-bit engines get the fp32 master weights copied into their tensors in place (CUDA
graphs keep pointing at the same storage) and the engine's prefix cache is dropped (its K/V belong to the
old weights). fp32 engines train their own tensors. Every `eval_every` steps the eval set is scored greedily.

Old logprobs without a recompute pass. In deterministic mode the sampler's logprob of a token has the bits
the trainer computes for it under the same weights, so the sampler's logprobs *are* pi_old: the no-grad
forward over every rollout token that other stacks run before the update is skipped (a forward is about a
third of a forward + backward, so with one update per rollout this saves about a quarter of the training
compute). It is run only where the sampler's logprobs cannot serve, when there is more than one update: at
temperature != 1 (the engine reports untempered logprobs), and in the fast arms, whose sampler logprobs
differ from the trainer's: there pi_old is the trainer's, as in other stacks (fast ignores the mismatch,
fast-tis corrects it with its truncated weight). The mismatch statistics compare the sampler's
logprobs with the trainer's before the first update: every token when there is one update or a recompute
pass, else the first mini-batch's tokens.

On one GPU the sampler and the trainer share the model's weight tensors: nothing is reloaded between steps.
A tensor-parallel or split sampler is an engine of its own, fed by a weight push after every update
(rl/engines.py); with trainer_ranks > 1 the trainer is FSDP-sharded over processes that follow this one
(rl/trainer_ranks.py).
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from detinfer.rl.config import ARMS, RLConfig, arm_engine_mode
from detinfer.rl.data import build_task_and_eval, encode_prompt
from detinfer.rl.engines import push_to_sampler, run_engines
from detinfer.rl.loss import build_optimizer, clipped_objective, k3_kl, lr_at, token_norms
from detinfer.rl.metrics import group_advantages, mismatch_stats, weights_fingerprint
from detinfer.rl.rewards import RewardModel, RewardScores, overlong_punishment, parse_reward_config
from detinfer.rl.rollout import Rollout, ctrl_c_deferred, request_seed, reward_batch
from detinfer.rl.tasks import Example, Task, epoch_of_step, examples_for_step
from detinfer.rl.trainer_ranks import (
    full,
    gathered_checkpoint,
    merged_across_ranks,
    push_gathered,
    rank_block,
    shareable,
    summed_across_ranks,
)
from detinfer.train.logprobs import LOGPROB_CHUNK_ROWS


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mean(xs) -> float:
    xs = list(xs)
    return math.fsum(xs) / len(xs) if xs else 0.0


class GRPOTrainer:
    """See the module doc. `model`: a model directory / hub id, or an already built `detinfer.engine.LLM`
    whose mode matches the arm. `task`: a `Task` (bring your own) or None for config.dataset / config.task."""

    def __init__(self, model, config: RLConfig | None = None, arm: str = "deterministic", *,
                 task: Task | str | None = None, device=None, max_model_len: int = 512, _follower: bool = False):
        self.config = RLConfig() if config is None else config
        if not isinstance(self.config, RLConfig):
            raise TypeError(f"config must be an RLConfig, got {type(self.config).__name__}")
        if arm not in ARMS:
            raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
        c = self.config
        if arm == "fast-tis" and c.temperature != 1.0:
            raise ValueError("the fast-tis arm needs temperature 1: its weight pi_trainer / pi_sampler uses the "
                             "engine's logprobs, which are of the untempered distribution")
        self.arm, self.mode = arm, arm_engine_mode(arm)
        # data-parallel trainer ranks (rl/trainer_ranks.py): rank 0 samples and leads, the others follow
        self.dp_size, self.dp_rank, self._followers, self._fingerprint = c.trainer_ranks, 0, None, None
        self._threads_before: int | None = None  # torch's thread count before a trainer rank's share
        if _follower:
            import torch.distributed as dist

            self.dp_rank, self.task, self.eval_examples, self.rewards = dist.get_rank(), None, [], None
        else:
            self.task, self.eval_examples = build_task_and_eval(c, task)
            self.rewards = RewardModel(parse_reward_config(c.reward_funcs, c.reward_weights), self.task)
        self.llm, self.train_llm, self._followers, self._owns_engines = run_engines(
            model, c, arm, device, max_model_len, follower=_follower, eval_size=len(self.eval_examples),
            trainer_class=type(self))
        self.engine = None if self.llm is None else self.llm.engine  # the sampler's (TP: rank 0 of it)
        self.tokenizer = None if self.engine is None else self.engine.tokenizer
        self.device = self.train_llm.engine.device  # where the trainer's tensors live
        self.reference = self.trainer = self.optimizer = None
        try:
            self._build_trainer(c)
        except BaseException:  # e.g. out of memory while sharding: no engine, worker or follower left behind
            if self._followers is not None:  # they may wait in a collective this rank never joins: end them
                self._followers.broken = True
            self.close()
            raise

    def _build_trainer(self, c: RLConfig) -> None:
        """The trainer (FSDP-sharded with trainer ranks), the reference policy if used, the optimizer."""
        from detinfer.train import TrainableModel

        # The reference policy for the KL penalty: a frozen copy of the initial weights, kept only when
        # used (it costs one more copy of the weights in memory and a no-grad forward per micro-batch).
        if c.kl_coef > 0:
            ref_model = copy.deepcopy(self.train_llm.engine.runner.model)
            self.reference = TrainableModel(ref_model, mode=self.mode, master_weights=False)
        self.trainer = TrainableModel(self.train_llm, mode=self.mode,
                                      logprob_chunk_rows=None if c.keep_logits else LOGPROB_CHUNK_ROWS)
        if self.dp_size > 1:
            from detinfer.train.fsdp import FSDPTrainer

            self.trainer = FSDPTrainer(self.trainer)
        if c.offload_optimizer and self.dp_size > 1:
            # The T trainer ranks share one host (one node) and step their shards' AdamW on its CPU at the
            # same time: each takes 1/T of torch's threads instead of all of them (measured on an H100 host,
            # two 1.34 B-parameter host steps at once: 0.65 -> 0.50 s each; docs/performance.md). Thread
            # counts change no bit of the elementwise step. `close` gives the process its count back.
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(max(1, self._threads_before // self.dp_size))
        # sharded AdamW: the single-tensor loop, whose elementwise update of a shard is the full tensor's
        self.optimizer = build_optimizer(self.trainer.named_parameters(), c, single_tensor=self.dp_size > 1)
        self.step_index = 0  # steps done
        self.history: list[dict] = []
        if self.dp_size > 1:
            self.refresh_fingerprint()

    # -- one step ------------------------------------------------------------------------------------
    def step(self) -> dict:
        """Run one GRPO step; returns (and appends to `history`) its metrics. Ctrl-C (KeyboardInterrupt)
        leaves the trainer at the last finished step: the update itself is never cut in half."""
        t0 = time.perf_counter()
        rollout = self.rollout(self.step_index)
        _sync(self.device)
        t1 = time.perf_counter()
        with ctrl_c_deferred():  # the weights, optimizer state, step count and history change together
            with self._sampler_kv_released(), \
                    contextlib.nullcontext() if self._followers is None else self._followers.guard():
                if self._followers is not None:  # the other trainer ranks join this update
                    self._followers.send("update", (self.step_index, shareable(rollout)))
                stats = self.update(rollout)
                if self.dp_size > 1:
                    self.refresh_fingerprint()
            _sync(self.device)
            t2 = time.perf_counter()
            self.step_index += 1
            lengths = [len(c) for c in rollout.completion_ids]
            scores = rollout.scores
            record = {"step": self.step_index, "reward_mean": _mean(rollout.rewards),
                      "response_len_mean": _mean(lengths), "truncated_frac": _mean(rollout.truncated),
                      **{f"reward/{k}": _mean(x for x in v if not math.isnan(x)) for k, v in scores.per_func.items()},
                      "reward_failures": scores.failed_samples,
                      **{f"reward_failures/{k}": v for k, v in scores.failures.items()},
                      "reward_error": scores.first_error, **stats,
                      "weights_hash": self.fingerprint(), "rollout_s": t1 - t0, "train_s": t2 - t1,
                      "step_s": t2 - t0, "sample_text": rollout.texts[0][:200]}
            epoch = epoch_of_step(self.task, self.step_index, self.config.prompts_per_step)
            if epoch is not None:
                record["epoch"] = epoch
            every = self.config.eval_every
            if every and self.step_index % every == 0:
                record.update(self.evaluate())
            self.history.append(record)
        return record

    @contextlib.contextmanager
    def _sampler_kv_released(self):
        """Colocated layout: the sampler's KV pool gives its memory to the update and gets it back after
        (rl/engines.py builds that sampler with a releasable pool; its prefix cache is dropped anyway by the
        weight push). Other layouts: nothing."""
        release = self.llm is not None and self.config.layout == "colocated" and self._owns_engines
        if release:
            self.llm.release_kv_cache()
        try:
            yield
        finally:
            if release:
                self.llm.restore_kv_cache()

    def encode(self, example: Example) -> list[int]:
        return encode_prompt(self.tokenizer, example.prompt, chat=self.task.chat,
                             system_prompt=self.config.system_prompt)

    def score_rewards(self, examples: Sequence[Example], texts, ids) -> RewardScores:
        return self.rewards.score(reward_batch(examples, texts, ids))

    def rollout(self, step: int) -> Rollout:
        from detinfer.engine import SamplingParams

        c = self.config
        examples = examples_for_step(self.task, c.seed, step, c.prompts_per_step)
        prompts = [self.encode(ex) for ex in examples]
        params = [SamplingParams(n=c.n_samples, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                                 max_tokens=c.max_tokens, logprobs=0, seed=request_seed(c.seed, step, i))
                  for i in range(len(prompts))]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        r = Rollout([], [], [], [], [], [])
        for ex, prompt, out in zip(examples, prompts, outs):
            for sample in out.outputs:
                r.examples.append(ex)
                r.prompt_ids.append(prompt)
                r.completion_ids.append(list(sample.token_ids))
                r.texts.append(sample.text)
                r.sampler_logprobs.append([e.logprob for e in sample.logprobs])
                r.truncated.append(sample.finish_reason == "length")
        r.scores = self.score_rewards(r.examples, r.texts, r.completion_ids)
        r.rewards = [total + overlong_punishment(len(ids), c.max_tokens, c.overlong_buffer, c.overlong_penalty)
                     for total, ids in zip(r.scores.total, r.completion_ids)]
        return r

    # -- the update ----------------------------------------------------------------------------------
    def update(self, r: Rollout) -> dict:
        """`ppo_epochs` passes over the rollout in mini-batches (one optimizer update each); returns the
        loss, clipping and mismatch statistics."""
        c = self.config
        n = len(r.completion_ids)
        advantages = group_advantages(r.rewards, c.n_samples, c.scale_rewards)
        keep = [not (c.mask_truncated and t) for t in r.truncated]
        size = n if c.mini_batch_seqs is None else c.mini_batch_seqs
        updates = c.ppo_epochs * -(-n // size)
        first = list(range(min(size, n)))
        # pi_old per sequence: the sampler's logprobs, unless they cannot be (see the module doc)
        old = None
        if updates > 1 and (c.temperature != 1.0 or self.arm != "deterministic"):
            old = self._score_no_grad(r, range(n), c.temperature)
        # the trainer's pre-update logprobs for the mismatch statistics: the recompute pass if it ran, else
        # the first mini-batch's pass fills them in; at temperature != 1 an untempered pass (the engine's kind)
        before = old if c.temperature == 1.0 else self._score_no_grad(r, first, 1.0)
        totals = {"loss": 0.0, "grad_norm": 0.0, "clip_tokens": 0, "tis_clipped": 0, "tokens": 0}
        done = self.step_index * c.updates_per_step
        lr = c.lr
        for epoch in range(c.ppo_epochs):
            order = list(range(n))
            if epoch:
                random.Random(f"detinfer-rl/minibatch/{c.seed}/{self.step_index}/{epoch}").shuffle(order)
            for start in range(0, n, size):
                seqs = order[start:start + size]
                capture = before is None and epoch == 0 and start == 0
                lr = lr_at(done, c.steps * c.updates_per_step, c)
                first_lps = self._update_once(r, seqs, advantages, keep, old, lr, totals, capture)
                if capture:
                    before = first_lps
                done += 1
        if self.dp_size > 1:
            totals = summed_across_ranks(totals, ("loss", "clip_tokens", "tis_clipped", "tokens"))
        scored = sorted(before)
        trainer_lp = torch.cat([before[j].cpu() for j in scored]) if scored else torch.zeros(0)
        sampler_lp = torch.tensor([x for j in scored for x in r.sampler_logprobs[j]], dtype=torch.float32)
        mismatch = mismatch_stats(trainer_lp.cpu(), sampler_lp)
        tokens = max(1, totals["tokens"])
        return {"loss": totals["loss"] / updates,
                "grad_norm": None if c.max_grad_norm is None else totals["grad_norm"] / updates,
                "lr": lr, "updates": updates, "clip_frac": totals["clip_tokens"] / tokens,
                **{f"mismatch_{k}": v for k, v in mismatch.items()},
                "tis_clipped_frac": totals["tis_clipped"] / tokens if self.arm == "fast-tis" else None}

    def _update_once(self, r: Rollout, seqs: list[int], advantages, keep, old, lr: float, totals: dict,
                     capture: bool):
        """One optimizer update on sequences `seqs`; with `capture`, returns their trainer logprobs (before
        the update) per sequence."""
        c = self.config
        norms = token_norms([len(r.completion_ids[j]) for j in seqs], [keep[j] for j in seqs], c.loss_norm,
                            c.max_tokens)
        captured, offset = {}, 0
        if self.dp_size > 1:  # this rank's block of the mini-batch, and its tokens' share of the norms
            mine = rank_block(seqs, self.dp_rank, self.dp_size)
            offset = sum(len(r.completion_ids[j]) for j in seqs[:seqs.index(mine[0])])
            seqs = mine
        for mstart in range(0, len(seqs), c.train_batch_seqs):
            micro = seqs[mstart:mstart + c.train_batch_seqs]
            count = sum(len(r.completion_ids[j]) for j in micro)
            lps = self._micro_batch(r, micro, advantages, old, norms[offset:offset + count], totals)
            offset += count
            if capture:
                captured.update(lps)
        if capture and self.dp_size > 1:
            captured = merged_across_ranks(captured)
        grad_norm = None
        params = list(self.trainer.parameters())
        if c.max_grad_norm is not None:  # (over DTensor shards: the global norm, on every rank)
            grad_norm = float(full(torch.nn.utils.clip_grad_norm_(params, c.max_grad_norm)))
            totals["grad_norm"] += grad_norm
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.trainer.zero_grad()
        self.push_weights()
        return captured

    def push_weights(self) -> None:
        """The trained weights into the engine's tensors in place, and from there into a tensor-parallel
        sampler (rl/engines.py); every sampler's prefix cache dropped (its K/V are the old weights')."""
        if self.dp_size > 1:  # the full weights, gathered from the shards, into rank 0's sampler
            push_gathered(self.trainer.named_parameters(), self.llm)
            return
        self.trainer.push_weights()
        push_to_sampler(self.llm, self.train_llm)

    def _pack(self, r: Rollout, batch: Sequence[int]):
        ids, cu, positions = [], [0], []
        for j in batch:
            p, n = len(r.prompt_ids[j]), len(r.completion_ids[j])
            # score()'s entry i is log p(token i+1 | ..i): completion token k sits at entry p - 1 + k
            positions += range(cu[-1] + p - 1, cu[-1] + p - 1 + n)
            ids += r.prompt_ids[j] + r.completion_ids[j]
            cu.append(cu[-1] + p + n)
        # the positions stay on the host: score() validates them there (strictly increasing: sequences and
        # tokens in order) and computes logits for those rows only
        return torch.tensor(ids, dtype=torch.int64, device=self.device), cu, torch.tensor(positions, dtype=torch.int64)

    def _split(self, r: Rollout, batch: Sequence[int], flat: torch.Tensor) -> dict[int, torch.Tensor]:
        out, at = {}, 0
        for j in batch:
            n = len(r.completion_ids[j])
            out[j] = flat[at:at + n]
            at += n
        return out

    @torch.no_grad()
    def _score_no_grad(self, r: Rollout, seqs, temperature: float) -> dict[int, torch.Tensor]:
        """Trainer logprobs of sequences `seqs`' completion tokens under the current weights, no autograd."""
        out, seqs = {}, list(seqs)
        if self.dp_size > 1:
            seqs = rank_block(seqs, self.dp_rank, self.dp_size)
        for start in range(0, len(seqs), self.config.train_batch_seqs):
            micro = seqs[start:start + self.config.train_batch_seqs]
            token_ids, cu, index = self._pack(r, micro)
            lp = self.trainer.score(token_ids, cu, positions=index, temperature=temperature)
            out.update(self._split(r, micro, lp))
        return merged_across_ranks(out) if self.dp_size > 1 else out

    def _micro_batch(self, r: Rollout, batch: Sequence[int], advantages, old, norms, totals: dict):
        c = self.config
        dev = self.device
        token_ids, cu, index = self._pack(r, batch)
        lp = self.trainer.score(token_ids, cu, positions=index, temperature=c.temperature)  # completion rows only
        sampler_lp = torch.tensor([x for j in batch for x in r.sampler_logprobs[j]], dtype=torch.float32, device=dev)
        adv = torch.tensor([advantages[j] for j in batch for _ in r.completion_ids[j]], dtype=torch.float32,
                           device=dev)
        norm = torch.tensor(norms, dtype=torch.float32, device=dev)
        if old is not None:
            old_lp = torch.cat([old[j] for j in batch]).to(dev)
        elif self.arm != "deterministic" or c.temperature != 1.0:
            old_lp = lp.detach()  # one update per rollout: this pass is the pre-update policy
        else:
            old_lp = sampler_lp  # deterministic: the trainer's bits under the rollout's weights
        eps_high = c.clip_eps if c.clip_eps_high is None else c.clip_eps_high
        objective, clip_active = clipped_objective(lp, old_lp, adv, c.clip_eps, eps_high)
        if self.arm == "fast-tis":
            # Truncated importance weight of the trainer's pre-update policy over the sampler's, detached.
            ratio = torch.exp(old_lp - sampler_lp)
            totals["tis_clipped"] += int((ratio > c.tis_cap).sum())
            objective = objective * ratio.clamp(max=c.tis_cap)
        if self.reference is not None:
            with torch.no_grad():
                ref_lp = self.reference.score(token_ids, cu, positions=index, temperature=c.temperature)
            objective = objective - c.kl_coef * k3_kl(lp, ref_lp)
        loss = -(objective * norm).sum()
        loss.backward()
        totals["loss"] += float(loss.detach())
        totals["clip_tokens"] += int(clip_active.sum())
        totals["tokens"] += int(lp.numel())
        return self._split(r, batch, lp.detach())

    # -- evaluation ----------------------------------------------------------------------------------
    def evaluate(self) -> dict:
        """Greedy completions of the eval set, scored by the run's reward functions: eval_reward_mean,
        eval_accuracy (share of examples with full marks: total reward >= the sum of the positive
        weights), each function's mean and failures."""
        from detinfer.engine import SamplingParams

        if not self.eval_examples:
            raise ValueError("no eval set: set eval_size > 0 or an eval_dataset")
        c = self.config
        prompts = [self.encode(ex) for ex in self.eval_examples]
        outs = self.llm.generate(prompts, SamplingParams(n=1, temperature=0.0, max_tokens=c.max_tokens),
                                 use_tqdm=False)
        texts = [o.outputs[0].text for o in outs]
        ids = [list(o.outputs[0].token_ids) for o in outs]
        scores = self.score_rewards(self.eval_examples, texts, ids)
        full = math.fsum(w for _, w, _ in self.rewards.specs if w > 0)
        return {"eval_examples": len(texts), "eval_reward_mean": _mean(scores.total),
                "eval_accuracy": _mean(float(t >= full - 1e-9) for t in scores.total),
                "eval_response_len_mean": _mean(len(x) for x in ids),
                **{f"eval_reward/{k}": _mean(x for x in v if not math.isnan(x)) for k, v in scores.per_func.items()},
                "eval_reward_failures": scores.failed_samples}

    # -- state ---------------------------------------------------------------------------------------
    def named_parameters(self):
        """The trained weights (fp32 masters for 16-bit engines), by name."""
        return list(self.trainer.named_parameters())

    def fingerprint(self) -> str:
        if self.dp_size > 1:  # computed by every rank together after each update (a collective)
            return self._fingerprint
        return weights_fingerprint(self.named_parameters())

    def refresh_fingerprint(self) -> None:
        """Trainer ranks > 1: the fingerprint of the full weights, gathered tensor by tensor (every rank)."""
        self._fingerprint = weights_fingerprint((n, full(p)) for n, p in self.trainer.named_parameters())

    def restore_shards(self, directory: str) -> None:
        """A trainer rank > 0's part of a resume: its shards of the checkpoint rank 0 validated."""
        from detinfer.rl.checkpoint import read_state, restore_tensors

        restore_tensors(self, Path(directory), read_state(directory))

    def checkpoint_tensors(self) -> tuple[dict, dict]:
        """({name: weight}, {name::key: AdamW state}) on the CPU, full tensors (trainer ranks > 1: gathered
        from the shards, every rank taking part; rank 0 tells the others)."""
        params = list(self.trainer.named_parameters()) if self.dp_size > 1 else self.named_parameters()
        if self._followers is None:
            return gathered_checkpoint(params, self.optimizer)
        with self._followers.guard():  # a trainer rank that died is named, with its exit code
            self._followers.send("checkpoint")
            return gathered_checkpoint(params, self.optimizer)

    def close(self) -> None:
        """Release the trainer's hooks and the engine (frees GPU memory for the next arm)."""
        if self.dp_size == 1 and self.trainer is not None:  # (FSDP took over the trainer's weights)
            self.trainer.close()
        if self._followers is not None:
            self._followers.close()
        if self.reference is not None:
            self.reference.close()
        if self._owns_engines and self.llm is not self.train_llm:
            if self.llm is not None:
                self.llm.close()  # a tensor-parallel sampler's worker processes
            self.train_llm.close()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        self.llm = self.train_llm = self.engine = self.trainer = self.reference = self.optimizer = None
