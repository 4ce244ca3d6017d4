"""`GRPOTrainer`: sampler and trainer in one process, on one set of weights.

    from detinfer.rl import GRPOTrainer, RLConfig
    trainer = GRPOTrainer("path/to/model", RLConfig(task="addition", steps=50), arm="deterministic")
    for _ in range(trainer.config.steps):
        print(trainer.step())          # reward, response length, mismatch, weights hash, timings

One step: draw the step's prompts (a pure function of (seed, step)) -> the engine samples `n_samples`
completions per prompt at temperature 1, each request seeded from (seed, step, prompt) and each sample
drawn from (that seed, position, sample index), with the sampler's logprob of every token -> the task
scores them -> group-relative advantages -> the trainer re-scores the same tokens with autograd (these are
the logprobs the mismatch statistics compare with the sampler's) -> policy-gradient loss, backward in
fixed micro-batches -> clip, AdamW step -> `push_weights()`: 16-bit engines get the fp32 master weights
copied into their tensors in place (CUDA graphs keep pointing at the same storage) and the engine's
prefix cache is dropped (its K/V belong to the old weights). fp32 engines train their own tensors.

The sampler and the trainer share the model's weight tensors: nothing is reloaded between steps.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from detinfer.engine.config import MAX_SEED
from detinfer.rl.config import ARMS, RLConfig, arm_engine_mode
from detinfer.rl.metrics import group_advantages, mismatch_stats, weights_fingerprint
from detinfer.rl.tasks import Example, Task, check_reward, examples_for_step, get_task

KV_BLOCK_SIZE = 16


def request_seed(seed: int, step: int, prompt_index: int) -> int:
    """The sampling seed of one prompt's request at one step; sample i of it draws from (this seed,
    position, i) in the engine's sampler, so every draw is a pure function of (seed, step, prompt, sample)."""
    digest = hashlib.sha256(f"detinfer-rl/sample/{seed}/{step}/{prompt_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & MAX_SEED


@dataclass
class Rollout:
    """One step's samples, flattened prompt-major (prompt i's samples at i * n .. i * n + n - 1)."""

    examples: list[Example]
    prompt_ids: list[list[int]]       # per sample (repeated within a group)
    completion_ids: list[list[int]]
    texts: list[str]
    sampler_logprobs: list[list[float]]
    rewards: list[float]


@contextlib.contextmanager
def ctrl_c_deferred():
    """Ctrl-C (SIGINT) arriving inside the block takes effect when it ends, so that state which must change
    together (a step's weights, optimizer state and step count) is never left half-changed, and a checkpoint
    saved after the interrupt holds whole steps. Only in the main thread (signals go only there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if pending:
            if callable(previous):
                previous(signal.SIGINT, pending[0])  # Python's default handler raises KeyboardInterrupt
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class GRPOTrainer:
    """See the module doc. `model`: a model directory / hub id, or an already built `detinfer.engine.LLM`
    whose mode matches the arm. `task`: a `Task` (bring your own) or None for `config.task`."""

    def __init__(self, model, config: RLConfig | None = None, arm: str = "deterministic", *,
                 task: Task | str | None = None, device=None, max_model_len: int = 512):
        from detinfer.engine import LLM
        from detinfer.train import TrainableModel

        self.config = RLConfig() if config is None else config
        if not isinstance(self.config, RLConfig):
            raise TypeError(f"config must be an RLConfig, got {type(self.config).__name__}")
        if arm not in ARMS:
            raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
        self.arm, self.mode = arm, arm_engine_mode(arm)
        self.task = get_task(self.config.task if task is None else task)
        c = self.config
        if isinstance(model, LLM):
            if model.engine.config.mode != self.mode:
                raise ValueError(f"arm {arm!r} samples in {self.mode} mode; the given LLM runs in "
                                 f"{model.engine.config.mode} mode")
            self.llm = model
        else:
            seqs = c.prompts_per_step * c.n_samples
            # A KV pool that holds a whole step's sequences at max_model_len (prompts within a group share
            # their blocks besides), sized explicitly: the default would fill the GPU the trainer needs.
            blocks = seqs * -(-max_model_len // KV_BLOCK_SIZE) + 1
            self.llm = LLM(str(model), device=device, mode=self.mode, dtype=c.dtype, block_size=KV_BLOCK_SIZE,
                           num_kv_blocks=blocks, max_model_len=max_model_len,
                           max_num_seqs=min(c.max_num_seqs, seqs),
                           max_num_batched_tokens=max(c.max_num_batched_tokens, min(c.max_num_seqs, seqs)),
                           enforce_eager=c.enforce_eager)
        self.engine = self.llm.engine
        self.tokenizer = self.engine.tokenizer
        self.device = self.engine.device
        # The reference policy for the KL penalty: a frozen copy of the initial weights (only when used).
        self.reference = None
        if c.kl_coef > 0:
            ref_model = copy.deepcopy(self.engine.runner.model)
            self.reference = TrainableModel(ref_model, mode=self.mode, master_weights=False)
        self.trainer = TrainableModel(self.llm, mode=self.mode)
        self.optimizer = torch.optim.AdamW(list(self.trainer.parameters()), lr=c.lr, weight_decay=c.weight_decay)
        self.step_index = 0  # steps done
        self.history: list[dict] = []

    # -- one step ------------------------------------------------------------------------------------
    def step(self) -> dict:
        """Run one GRPO step; returns (and appends to `history`) its metrics. Ctrl-C (KeyboardInterrupt)
        leaves the trainer at the last finished step: the update itself is never cut in half."""
        t0 = time.perf_counter()
        rollout = self.rollout(self.step_index)
        _sync(self.device)
        t1 = time.perf_counter()
        grads = self._backward(rollout)
        with ctrl_c_deferred():  # the weights, optimizer state, step count and history change together
            stats = self._apply(grads)
            _sync(self.device)
            t2 = time.perf_counter()
            self.step_index += 1
            lengths = [len(c) for c in rollout.completion_ids]
            record = {"step": self.step_index, "reward_mean": sum(rollout.rewards) / len(rollout.rewards),
                      "response_len_mean": sum(lengths) / len(lengths), **stats,
                      "weights_hash": self.fingerprint(), "rollout_s": t1 - t0, "train_s": t2 - t1,
                      "step_s": t2 - t0, "sample_text": rollout.texts[0][:200]}
            self.history.append(record)
        return record

    def encode(self, example: Example) -> list[int]:
        if not isinstance(example.prompt, str):
            return [int(t) for t in example.prompt]
        if self.tokenizer is None:
            raise ValueError(f"task {self.task.name!r} gives text prompts; this engine has no tokenizer")
        if self.task.chat and getattr(self.tokenizer, "chat_template", None):
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": example.prompt}],
                                                          add_generation_prompt=True, tokenize=True))
        return list(self.tokenizer.encode(example.prompt))

    def rollout(self, step: int) -> Rollout:
        from detinfer.engine import SamplingParams

        c = self.config
        examples = examples_for_step(self.task, c.seed, step, c.prompts_per_step)
        prompts = [self.encode(ex) for ex in examples]
        params = [SamplingParams(n=c.n_samples, temperature=1.0, max_tokens=c.max_tokens, logprobs=0,
                                 seed=request_seed(c.seed, step, i)) for i in range(len(prompts))]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        r = Rollout(examples, [], [], [], [], [])
        for ex, prompt, out in zip(examples, prompts, outs):
            for sample in out.outputs:
                r.prompt_ids.append(prompt)
                r.completion_ids.append(list(sample.token_ids))
                r.texts.append(sample.text)
                r.sampler_logprobs.append([e.logprob for e in sample.logprobs])
                r.rewards.append(check_reward(self.task.reward(ex, sample.text, tuple(sample.token_ids)),
                                              self.task))
        return r

    def update(self, r: Rollout) -> dict:
        """Policy-gradient step on one rollout; returns the loss and mismatch statistics."""
        return self._apply(self._backward(r))

    def _backward(self, r: Rollout) -> dict:
        """Accumulate the rollout's gradients (micro-batches in a fixed order); a Ctrl-C here drops them."""
        c = self.config
        try:
            advantages = group_advantages(r.rewards, c.n_samples, c.scale_rewards)
            total_tokens = sum(len(x) for x in r.completion_ids)
            trainer_lps, sampler_lps, clipped, loss_sum = [], [], 0, 0.0
            for start in range(0, len(r.completion_ids), c.train_batch_seqs):
                batch = range(start, min(start + c.train_batch_seqs, len(r.completion_ids)))
                lp, s_lp, n_clipped, loss = self._micro_batch(r, batch, advantages, total_tokens)
                trainer_lps.append(lp)
                sampler_lps.append(s_lp)
                clipped += n_clipped
                loss_sum += loss
        except BaseException:
            self.trainer.zero_grad()  # half a step's gradients must not leak into the next step
            raise
        return {"trainer_lps": trainer_lps, "sampler_lps": sampler_lps, "clipped": clipped, "loss": loss_sum,
                "total_tokens": total_tokens}

    def _apply(self, g: dict) -> dict:
        """Clip, optimizer step, push the weights to the engine; the step's statistics."""
        c = self.config
        params = list(self.trainer.parameters())
        grad_norm = None
        if c.max_grad_norm is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, c.max_grad_norm))
        self.optimizer.step()
        self.trainer.zero_grad()
        self.trainer.push_weights()  # in-place copy into the engine's tensors + prefix cache dropped
        mismatch = mismatch_stats(torch.cat(g["trainer_lps"]), torch.cat(g["sampler_lps"]))
        return {"loss": g["loss"], "grad_norm": grad_norm, **{f"mismatch_{k}": v for k, v in mismatch.items()},
                "tis_clipped_frac": g["clipped"] / max(1, g["total_tokens"]) if self.arm == "fast-tis" else None}

    def _micro_batch(self, r: Rollout, batch: Sequence[int], advantages: list[float], total_tokens: int):
        ids, cu, positions, adv, s_lp = [], [0], [], [], []
        for j in batch:
            seq = r.prompt_ids[j] + r.completion_ids[j]
            p, n = len(r.prompt_ids[j]), len(r.completion_ids[j])
            # score()'s entry i is log p(token i+1 | ..i): completion token k sits at entry p - 1 + k
            positions += range(cu[-1] + p - 1, cu[-1] + p - 1 + n)
            ids += seq
            cu.append(cu[-1] + len(seq))
            adv += [advantages[j]] * n
            s_lp += r.sampler_logprobs[j]
        dev = self.device
        token_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        index = torch.tensor(positions, dtype=torch.int64, device=dev)
        sampler_lp = torch.tensor(s_lp, dtype=torch.float32, device=dev)
        adv_t = torch.tensor(adv, dtype=torch.float32, device=dev)
        lp = self.trainer.score(token_ids, cu)[index]
        coef, n_clipped = adv_t, 0
        if self.arm == "fast-tis":
            # Truncated importance weight of the trainer's policy over the sampler's, per token, detached.
            ratio = torch.exp(lp.detach() - sampler_lp)
            n_clipped = int((ratio > self.config.tis_cap).sum())
            coef = coef * ratio.clamp(max=self.config.tis_cap)
        objective = coef * lp
        if self.reference is not None:
            with torch.no_grad():
                ref_lp = self.reference.score(token_ids, cu)[index]
            d = ref_lp - lp
            objective = objective - self.config.kl_coef * (torch.exp(d) - d - 1)  # k3 estimate of KL(pi||ref)
        # Token-level mean over the whole step (every micro-batch divides by the same count).
        loss = -objective.sum() / total_tokens
        loss.backward()
        return lp.detach(), sampler_lp, n_clipped, float(loss.detach())

    # -- state ---------------------------------------------------------------------------------------
    def named_parameters(self):
        """The trained weights (fp32 masters for 16-bit engines), by name."""
        return list(self.trainer.named_parameters())

    def fingerprint(self) -> str:
        return weights_fingerprint(self.named_parameters())

    def close(self) -> None:
        """Release the trainer's hooks and the engine (frees GPU memory for the next arm)."""
        self.trainer.close()
        if self.reference is not None:
            self.reference.close()
        self.llm = self.engine = self.trainer = self.reference = self.optimizer = None
